"""Task families where privacy and utility can coexist, shipped as JSONL chats beside the exact-answer control.

``shipped`` reads them (``task_files``, ``task_examples``, ``write_task_files``, ``task_dataset_config``) and needs
nothing beyond the package; ``sentiment_reviews`` (gist family, VADER's lexicon) and ``support_tickets`` (span
family, Faker) generate them, ``common`` holds what the generators share, and ``generate`` writes the files
(``scripts/make_task_data.py``). See ``docs/tasks.md``.
"""

from nemo_noise_plugin.data.tasks import shipped
from nemo_noise_plugin.data.tasks.shipped import *  # noqa: F403 - the package exports what ``shipped`` does

__all__ = list(shipped.__all__)  # the package exports what ``shipped`` does
