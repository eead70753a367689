"""The job runtime: `epl.init` and the cluster (TF_CONFIG, Slurm, devices, the collective
runtime), the `epl-launch` and `epl-plan` commands, the watchdog. The launcher and epl-plan
import no TensorFlow."""
