"""Moved to ``nemo_noise_plugin.jobs.launch.launcher`` (``launch_with_report``: ``jobs.main_job``); the old path."""

from nemo_noise_plugin.jobs.launch.launcher import *  # noqa: F403
from nemo_noise_plugin.jobs.main_job import launch_with_report  # noqa: F401
