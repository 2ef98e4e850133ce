"""Environment infrastructure: the plug-in interface (base), env-gateway's server and feeder,
the bus client and the in-process client. The environments themselves live in their domains
(libs.domains), found through libs.domains.registry.
"""

from libs.envs.base import Environment, Episode, Opening, StepResult, TaskSource

__all__ = ["Environment", "Episode", "Opening", "StepResult", "TaskSource"]
