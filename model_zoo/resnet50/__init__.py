"""ResNet-50 with EPL's recipes: data parallel, and a large classifier split across devices.

Run it::

    python -m model_zoo.resnet50                 # small ResNet, generated images, 2 devices
    python -m model_zoo.resnet50 --epl_config configs/resnet50_split.json

`model.py` builds the networks, `data.py` the input pipelines (generated images and
ImageNet TFRecords), `recipe.py` the layout and the run; `__main__.py` maps the absl
flags onto `recipe.Options`. This module stays empty on purpose: `python -m` imports the
package before it runs `__main__`, and the absl flags must be defined only once.
"""
