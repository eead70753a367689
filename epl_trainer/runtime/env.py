"""`epl.init()` and `epl.Env.get()`: the process-wide config and cluster, as in EPL."""

from __future__ import annotations

import logging
import threading

from epl_trainer.annotations import checkpoints, strategies
from epl_trainer.config.sections import Config
from epl_trainer.core.graph.peak import onednn_enabled
from epl_trainer.runtime import onednn
from epl_trainer.runtime.cluster import Cluster, build_cluster

logger = logging.getLogger(__name__)


class Env:
    """The current config and cluster. `Env.get()` initialises with defaults if needed."""

    _instance: Env | None = None
    _lock = threading.Lock()

    def __init__(self, config: Config, cluster: Cluster):
        self.config = config
        self.cluster = cluster

    @classmethod
    def get(cls) -> Env:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _make_env(Config())
            return cls._instance

    @classmethod
    def initialized(cls) -> bool:
        return cls._instance is not None


def init(config=None) -> Env:
    """Initialises epl_trainer for this process.

    Args:
      config: an `epl.Config`, a dict of dotted keys, a JSON/YAML path, or None for
        defaults (environment variables `EPL_<SECTION>_<KEY>` still apply).

    Configures TensorFlow's devices (the first call wins: TensorFlow cannot be
    reconfigured once running), starts the collective runtime for multi-worker jobs
    and clears annotations recorded by earlier `replicate`/`split` scopes and
    checkpoints marked with `add_to_collection`.
    """
    env = _make_env(Config.load(config))
    _say_onednn_choice()
    strategies.reset_annotations()
    checkpoints.clear_collections()
    with Env._lock:
        Env._instance = env
    return env


def _say_onednn_choice() -> None:
    """Logs what the package did about oneDNN (INFO: its kernels run), or how to get
    them when TensorFlow runs without (WARNING: steps several times slower)."""
    enabled = onednn_enabled()
    message = onednn.notice(enabled)
    if message:
        logger.log(logging.INFO if enabled else logging.WARNING, message)


def _make_env(config: Config) -> Env:
    return Env(config, build_cluster(config.cluster))
