"""A training run folder as ``nemo noise audit run=`` reads it: its HF export, its noise as trained, its data.

``read_run_folder`` reads JSON and YAML only (no model is loaded): ``reports/latest/hf``, the noise config from
``reports/latest/task_report.json`` or the newest checkpoint's ``run_config.yaml``, and ``data/*.jsonl``;
``check_hf_dir`` checks a folder given as ``hf_dir=``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = ["TrainedRun", "check_hf_dir", "read_run_folder"]


@dataclass(frozen=True)
class TrainedRun:
    """A training run folder as ``nemo noise audit run=`` audits it: its HF export and its noise as trained.

    Read by ``read_run_folder`` from the folder a SmolLM2 recipe or the main job trains into (``<dir>/<recipe>``):
    ``reports/latest/hf`` (``task_report.TaskReport``'s export), the noise config from ``reports/latest/
    task_report.json`` (its ``run``) or else from the newest Bridge checkpoint's ``checkpoints/iter_*/
    run_config.yaml``, and the run's data (``data/training.jsonl``, ``data/validation.jsonl``).
    """

    folder: Path
    hf_dir: Path
    noise: NoiseConfig
    """The noise config the run trained with."""
    noise_source: str
    """The file it was read from."""
    sequence_length: int | None = None
    epochs: int | None = None
    training_data: Path | None = None
    validation_data: Path | None = None

    @property
    def noise_at_inference(self) -> NoiseConfig:
        """The run's noise at its full level in eval mode (constant schedule, no warm-up): what is audited."""
        return dataclasses.replace(self.noise, training_only=False, schedule="constant", warmup_steps=0)


def read_run_folder(run: str) -> TrainedRun:
    """The ``TrainedRun`` of the folder ``run``; one ``ValueError`` naming ``run=``, the value and what was expected
    when the folder lacks the export or a noise config. Reads JSON and YAML only (no model is loaded). Example::

        trained = read_run_folder("nemo_experiments/smollm2_135m_noise_sft")
        trained.noise.mechanism, trained.hf_dir
    """
    folder = Path(run).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"run={run!r} is invalid: {'not a folder' if folder.exists() else 'no such folder'}; expected a training "
            "run folder (the folder a SmolLM2 recipe trains into, e.g. <output-dir>/smollm2_135m_noise_sft)."
        )
    hf_dir = folder / "reports" / "latest" / "hf"
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (hf_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"run={run!r} is invalid: expected its trained model's Hugging Face export in reports/latest/hf (written "
            f"by the SmolLM2 recipes' task report at the end of training); missing {', '.join(missing)} there."
        )
    noise, source, settings = _run_noise(folder, run)
    data = folder / "data"
    training = data / "training.jsonl"
    epochs = settings.get("epochs")
    if epochs is None and settings.get("samples") and training.is_file():
        examples = sum(1 for line in training.read_text().splitlines() if line.strip())
        epochs = max(1, -(-settings["samples"] // examples)) if examples else None
    return TrainedRun(
        folder=folder,
        hf_dir=hf_dir,
        noise=noise,
        noise_source=source,
        sequence_length=settings.get("seq_length"),
        epochs=epochs,
        training_data=training if training.is_file() else None,
        validation_data=data / "validation.jsonl" if (data / "validation.jsonl").is_file() else None,
    )


def _run_noise(folder: Path, run: str) -> tuple[NoiseConfig, str, dict[str, Any]]:
    """The run's noise config, the file it came from, and the ledger's settings (seq_length, epochs or samples)."""
    from nemo_noise_plugin.yaml_files import load_yaml_file

    report = folder / "reports" / "latest" / "task_report.json"
    if report.is_file():
        saved = json.loads(report.read_text()).get("run") or {}
        if isinstance(saved.get("noise"), dict):
            settings = {key: saved.get(key) for key in ("seq_length", "epochs")}
            return _noise_from(saved["noise"], run, report), str(report), settings
    checkpoints = sorted(
        (folder / "checkpoints").glob("iter_*/run_config.yaml"), key=lambda path: path.parent.name, reverse=True
    )
    for path in checkpoints:
        config = load_yaml_file(path, what="a ConfigContainer mapping, as ConfigContainer.to_yaml writes it")
        model, dataset, train = (config.get(name) or {} for name in ("model", "dataset", "train"))
        if isinstance(model.get("noise"), dict):
            settings = {
                "seq_length": dataset.get("seq_length") or model.get("seq_length"),
                "samples": int(train.get("train_iters") or 0) * int(train.get("global_batch_size") or 0),
            }
            return _noise_from(model["noise"], run, path), str(path), settings
    raise ValueError(
        f"run={run!r} is invalid: no noise config found; expected reports/latest/task_report.json with its 'run' "
        "section (written by the task report) or a Bridge checkpoint's checkpoints/iter_*/run_config.yaml with "
        "model.noise."
    )


def _noise_from(fields: dict[str, Any], run: str, path: Path) -> NoiseConfig:
    known = {field.name for field in dataclasses.fields(NoiseConfig)}
    values = {key: value for key, value in fields.items() if key in known}
    try:
        return NoiseConfig(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"run={run!r} is invalid: the noise config in {path} is not valid: {error}") from None


def check_hf_dir(hf_dir: str) -> Path:
    """``hf_dir`` as a folder holding a SmolLM2-architecture HF model; ``ValueError`` naming the setting if not."""
    folder = Path(hf_dir).expanduser()
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"hf_dir={hf_dir!r} is invalid: expected a Hugging Face folder with config.json, model.safetensors and "
            f"tokenizer.json (e.g. a main job's reports/latest/hf); missing {', '.join(missing)}."
        )
    return folder
