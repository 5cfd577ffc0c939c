"""Every YAML the plugin reads: ``1e-3`` is a number, a repeated key and an empty file are errors naming the file.

The rules (``nemo_noise_plugin.yaml_files``) first, then each reader: presets / ``load_noise_config`` and
``load_kd_config``, the main job's ``--noise-config``, ``--config-file`` through Bridge's override path,
``load_config_yaml``, ``nemo noise ledger`` / ``audit`` config files and their ``key=value`` arguments.
"""

from __future__ import annotations

import math
import re

import pytest
import yaml

from nemo_noise_plugin.yaml_files import YAMLInputError, load_yaml_file, load_yaml_value

NUMBERS = "lr: 1e-3\nalpha: 1e3\nsigma: -2.5E+4\nhalf: .5\nminus_half: -.5\ndotted: 1.e3\n"
WHAT = "a mapping of test fields"


def _file(tmp_path, text: str | bytes, name: str = "run.yaml"):
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


# --- the rules -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "number"),
    [("1e-3", 0.001), ("1E3", 1000.0), ("-2.5E+4", -25000.0), ("-2.5e+4", -25000.0), ("+1e3", 1000.0),
     (".5", 0.5), ("-.5", -0.5), ("1.e3", 1000.0), ("1.0e-3", 0.001), ("1_000.5", 1000.5)],
)  # fmt: skip
def test_exponent_and_leading_dot_floats_are_floats(text, number):
    value = load_yaml_value(text)
    assert type(value) is float and value == number


@pytest.mark.parametrize(("text", "number"), [("3", 3), ("-7", -7), ("0x1F", 31), ("1_000", 1000), ("0", 0)])
def test_integers_stay_integers_and_1_000_is_the_int_1000(text, number):
    value = load_yaml_value(text)
    assert type(value) is int and value == number


@pytest.mark.parametrize("text", ["1e", "e3", "1.2.3", "v1e3", "1e3x", "nan"])
def test_look_alikes_of_numbers_stay_strings(text):
    assert load_yaml_value(text) == text


def test_infinities_and_nan_keep_their_yaml_spelling():
    assert load_yaml_value(".inf") == math.inf and load_yaml_value("-.inf") == -math.inf
    assert math.isnan(load_yaml_value(".nan"))


def test_pyyaml_safe_loader_itself_is_unchanged():
    assert yaml.safe_load("1e-3") == "1e-3"  # the plugin's loader has its own resolver table


def test_an_empty_value_is_null():
    assert load_yaml_value("") is None and load_yaml_value("null") is None


def test_python_tags_are_refused(tmp_path):
    path = _file(tmp_path, "a: !!python/object/apply:os.system [echo hi]\n")
    with pytest.raises(YAMLInputError, match="could not determine a constructor"):
        load_yaml_file(path, what=WHAT)


def test_a_file_reads_every_spelling_of_a_float_as_that_number(tmp_path):
    values = load_yaml_file(_file(tmp_path, NUMBERS), what=WHAT)
    assert values == {"lr": 0.001, "alpha": 1000.0, "sigma": -25000.0, "half": 0.5, "minus_half": -0.5, "dotted": 1e3}
    assert all(type(value) is float for value in values.values())


def test_a_repeated_key_is_rejected_naming_the_file_the_key_and_both_lines(tmp_path):
    path = _file(tmp_path, "alpha: 1\nsigma: 2\nalpha: 3\n")
    with pytest.raises(YAMLInputError) as error:
        load_yaml_file(path, what=WHAT)
    assert str(error.value) == (
        f"{path}, line 3: duplicate key 'alpha' (first set on line 1); each key may appear once in a mapping."
    )


def test_a_repeated_key_in_a_nested_mapping_is_rejected(tmp_path):
    path = _file(tmp_path, "model:\n  noise:\n    alpha: 1\n    sigma: 2\n    alpha: 4\n")
    with pytest.raises(YAMLInputError, match=r"run.yaml, line 5: duplicate key 'alpha' \(first set on line 3\)"):
        load_yaml_file(path, what=WHAT)


def test_a_merge_key_is_not_a_repeat(tmp_path):
    path = _file(tmp_path, "base: &base {alpha: 1, sigma: 2}\nrun:\n  <<: *base\n  alpha: 5\n")
    assert load_yaml_file(path, what=WHAT)["run"] == {"alpha": 5, "sigma": 2}


@pytest.mark.parametrize("text", ["", "   \n\n", "# only a comment\n  # and another\n", "null\n", "---\n"])
def test_an_empty_file_is_rejected_naming_it(tmp_path, text):
    path = _file(tmp_path, text, "empty.yaml")
    with pytest.raises(YAMLInputError) as error:
        load_yaml_file(path, what=WHAT)
    assert str(error.value) == (
        f"{path}: the file is empty (nothing but whitespace, comments or null); expected a mapping of test fields."
    )


@pytest.mark.parametrize(
    ("text", "got"), [("- 1\n- 2\n", "a list ([1, 2])"), ("1e-3\n", "a number (0.001)"), ("hello\n", "a string")]
)
def test_a_top_level_that_is_not_a_mapping_is_rejected_naming_what_it_is(tmp_path, text, got):
    path = _file(tmp_path, text)
    with pytest.raises(YAMLInputError) as error:
        load_yaml_file(path, what=WHAT)
    assert str(error.value).startswith(f"{path}: expected a mapping of test fields, got {got}")


def test_a_binary_file_is_rejected_naming_it(tmp_path):
    path = _file(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00", "image.yaml")
    with pytest.raises(YAMLInputError) as error:
        load_yaml_file(path, what=WHAT)
    assert str(error.value) == (
        f"{path}: not a text file (byte 0x89 at position 0 is not UTF-8); expected a mapping of test fields, in UTF-8 "
        "text."
    )


def test_a_control_character_is_rejected_naming_the_file(tmp_path):
    path = _file(tmp_path, "alpha: 1\x00\n")
    with pytest.raises(YAMLInputError, match=r"run.yaml: not a text file \(character U\+0000 at position 8\)"):
        load_yaml_file(path, what=WHAT)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    assert load_yaml_file(_file(tmp_path, "\ufefflr: 1e-3\n".encode()), what=WHAT) == {"lr": 0.001}


def test_a_folder_is_rejected_as_unreadable_naming_it(tmp_path):
    with pytest.raises(YAMLInputError) as error:
        load_yaml_file(tmp_path, what=WHAT)
    assert str(error.value) == f"{tmp_path}: cannot be read (Is a directory); expected a mapping of test fields."


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_yaml_file(tmp_path / "missing.yaml", what=WHAT)


def test_a_syntax_error_names_the_file_and_the_line(tmp_path):
    path = _file(tmp_path, "alpha: 1\nsigma: [1, 2\n")
    with pytest.raises(YAMLInputError) as error:
        load_yaml_file(path, what=WHAT)
    assert str(error.value) == (
        f"{path}: not valid YAML: while parsing a flow sequence; expected ',' or ']', but got '<stream end>' "
        "(line 3, column 1)."
    )


def test_two_documents_are_rejected(tmp_path):
    with pytest.raises(YAMLInputError, match="expected a single document"):
        load_yaml_file(_file(tmp_path, "a: 1\n---\nb: 2\n"), what=WHAT)


def test_a_value_with_a_repeated_key_or_bad_syntax_is_rejected_naming_it():
    with pytest.raises(YAMLInputError) as error:
        load_yaml_value("{a: 1, a: 2}", what="argument 'x={a: 1, a: 2}'")
    assert str(error.value) == (
        "argument 'x={a: 1, a: 2}', line 1: duplicate key 'a' (first set on line 1); each key may appear once in a "
        "mapping."
    )
    with pytest.raises(YAMLInputError, match=r"^argument 'x=\[1': not valid YAML: .*expected a YAML value"):
        load_yaml_value("[1", what="argument 'x=[1'")


# --- presets: load_noise_config / load_kd_config ---------------------------------------------------------------


def test_a_noise_config_file_reads_exponent_floats(tmp_path):
    from nemo_noise_plugin.noise.config import load_noise_config

    path = _file(tmp_path, "mechanism: gaussian_mechanism\nclip_norm: 2e0\nepsilon: 4E0\ndelta: 1e-5\n")
    config = load_noise_config(path)
    assert (config.clip_norm, config.epsilon, config.delta) == (2.0, 4.0, 1e-5)
    assert load_noise_config(_file(tmp_path, "alpha: 1e1\n", "neftune.yaml")).alpha == 10.0


def test_a_kd_config_file_reads_exponent_floats(tmp_path):
    from nemo_noise_plugin.distillation.config import load_kd_config

    assert load_kd_config(_file(tmp_path, "temperature: 2e0\nkd_weight: 5e-1\n")).kd_weight == 0.5


def test_a_noise_config_file_with_a_repeated_key_is_rejected(tmp_path):
    from nemo_noise_plugin.noise.config import load_noise_config

    path = _file(tmp_path, "alpha: 5\nalpha: 15\n")
    with pytest.raises(YAMLInputError) as error:
        load_noise_config(path)
    assert str(error.value).startswith(f"{path}, line 2: duplicate key 'alpha' (first set on line 1)")


def test_an_empty_kd_config_file_is_rejected_naming_it(tmp_path):
    from nemo_noise_plugin.distillation.config import load_kd_config

    path = _file(tmp_path, "# nothing yet\n", "kd.yaml")
    with pytest.raises(YAMLInputError) as error:
        load_kd_config(path)
    assert str(error.value).startswith(f"{path}: the file is empty")
    assert str(error.value).endswith("expected a mapping of KDConfig fields (field: value).")


# --- the main job's --noise-config -----------------------------------------------------------------------------


def test_the_main_job_reads_exponent_floats_from_its_noise_config(tmp_path):
    from nemo_noise_plugin.cli.main_job import build_noise_config, parse_args

    path = _file(tmp_path, "mechanism: gaussian\nsigma: 2.5e0\n")
    noise = build_noise_config(parse_args(["--noise-config", str(path)]))
    assert (noise.mechanism, noise.sigma) == ("gaussian", 2.5)


def test_the_main_job_rejects_an_empty_noise_config_with_exit_status_2(tmp_path, capsys):
    """It used to run with NoiseConfig's defaults (NEFTune alpha 5, not the main job's 10)."""
    from nemo_noise_plugin.cli.main_job import main

    path = _file(tmp_path, "", "empty.yaml")
    assert main(["--noise-config", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --noise-config {path}: the file is empty (nothing but whitespace, comments or null); expected a "
        "mapping of NoiseConfig fields (field: value)."
    )
    assert not (tmp_path / "out").exists()


def test_the_main_job_rejects_a_repeated_key_in_its_noise_config(tmp_path, capsys):
    from nemo_noise_plugin.cli.main_job import main

    path = _file(tmp_path, "alpha: 5\nalpha: 15\n")
    assert main(["--noise-config", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --noise-config {path}, line 2: duplicate key 'alpha' (first set on line 1); each key may appear once "
        "in a mapping."
    )


# --- nemo noise ledger / audit ---------------------------------------------------------------------------------


def test_key_value_arguments_read_exponent_floats():
    from nemo_noise_plugin.yaml_files import parse_key_values

    values = parse_key_values(["tokens=1e3", "delta=1e-6", "epochs=3", "clip_norm=null"])
    assert values == {"tokens": 1000.0, "delta": 1e-6, "epochs": 3, "clip_norm": None}
    assert type(values["tokens"]) is float and type(values["epochs"]) is int


def test_a_key_value_argument_that_is_not_yaml_is_one_error_naming_it():
    from nemo_noise_plugin.yaml_files import parse_key_values

    with pytest.raises(YAMLInputError, match=r"^argument 'special_token_ids=\[1, 2': not valid YAML"):
        parse_key_values(["special_token_ids=[1, 2"])


def test_the_ledger_of_an_exponent_config_file_equals_that_of_the_dotted_one(tmp_path):
    from nemo_noise_plugin.cli.nemo_noise import run_ledger

    exponent = _file(tmp_path, "mechanism: gaussian_mechanism\nclip_norm: 2e0\nepsilon: 4e0\ndelta: 1e-5\n", "e.yaml")
    dotted = _file(tmp_path, "mechanism: gaussian_mechanism\nclip_norm: 2.0\nepsilon: 4.0\ndelta: 1.0e-5\n", "d.yaml")
    table = run_ledger([f"config={exponent}", "sequence_length=8", "delta=1e-6"])
    assert table == run_ledger([f"config={dotted}", "sequence_length=8", "delta=0.000001"])
    assert "sensitivity 2C          4 " in table


def test_the_ledger_rejects_an_empty_config_file_naming_it(tmp_path):
    from nemo_noise_plugin.cli.nemo_noise import run_ledger

    path = _file(tmp_path, "\n", "empty.yaml")
    with pytest.raises(YAMLInputError, match=rf"^{re.escape(str(path))}: the file is empty"):
        run_ledger([f"config={path}", "sequence_length=8"])


def test_the_audit_reads_exponent_floats_from_its_config_file(tmp_path):
    from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments

    path = _file(tmp_path, "mechanism: gaussian\nsigma: 1e1\n")
    settings = parse_audit_arguments(
        ["model=tiny", "sweep=sigma:1,5", f"config={path}", f"output_dir={tmp_path}", "clip_norm=2e0"]
    )
    assert (settings["config"].sigma, settings["config"].clip_norm) == (10.0, 2.0)


# --- --config-file and load_config_yaml through Bridge ---------------------------------------------------------


@pytest.fixture(scope="module")
def bridge(megatron_cpu):
    from nemo_noise_plugin import recipes
    from nemo_noise_plugin.jobs.launch import finetune
    from nemo_noise_plugin.training import overrides

    return dict(recipes=recipes, overrides=overrides, finetune=finetune)


def test_a_config_file_sets_exponent_floats_through_bridges_override_path(bridge, tmp_path):
    config = bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path))
    path = _file(tmp_path, "optimizer:\n  lr: 1e-3\n  weight_decay: 1E-2\nmodel:\n  noise:\n    alpha: 1.5e+1\n")
    bridge["overrides"].apply_overrides(config, [], config_filepath=path)
    assert (config.optimizer.lr, config.optimizer.weight_decay, config.model.noise.alpha) == (0.001, 0.01, 15.0)
    assert type(config.optimizer.lr) is float


def test_the_finetune_command_rejects_an_empty_config_file_naming_it(bridge, tmp_path):
    path = _file(tmp_path, "# to fill in\n", "empty.yaml")
    with pytest.raises(bridge["finetune"].FinetuneError) as error:
        bridge["finetune"].run_finetune(
            "tiny_noise_sft", [f"checkpoint.save={tmp_path}/ckpt"], config_file=str(path), dryrun=True, print_fn=print
        )
    assert str(error.value) == (
        f"invalid --config-file or override: config file {path}: the file is empty (nothing but whitespace, comments "
        "or null); expected a mapping of config fields (e.g. model: {noise: {alpha: 10}})."
    )


def test_a_config_file_with_a_repeated_key_is_rejected_naming_key_and_line(bridge, tmp_path):
    config = bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path))
    path = _file(tmp_path, "train:\n  train_iters: 5\n  train_iters: 50\n")
    with pytest.raises(bridge["overrides"].ConfigOverrideError) as error:
        bridge["overrides"].apply_overrides(config, [], config_filepath=path)
    assert str(error.value) == (
        f"config file {path}, line 3: duplicate key 'train_iters' (first set on line 2); each key may appear once in a "
        "mapping."
    )


def test_load_config_yaml_reads_an_edited_run_config_with_exponent_floats(bridge, tmp_path):
    path = tmp_path / "run_config.yaml"
    bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path)).to_yaml(str(path))
    values = yaml.safe_load(path.read_text())
    values["optimizer"]["lr"] = "LR"
    path.write_text(yaml.safe_dump(values).replace("lr: LR", "lr: 3e-4"))
    assert bridge["overrides"].load_config_yaml(path).optimizer.lr == 0.0003


def test_load_config_yaml_rejects_a_repeated_key(bridge, tmp_path):
    path = tmp_path / "run_config.yaml"
    bridge["recipes"].tiny_noise_sft_config(dir=str(tmp_path)).to_yaml(str(path))
    path.write_text(path.read_text() + "model: {}\n")
    lines = path.read_text().splitlines()
    with pytest.raises(YAMLInputError) as error:
        bridge["overrides"].load_config_yaml(path)
    assert str(error.value).startswith(
        f"{path}, line {len(lines)}: duplicate key 'model' (first set on line {lines.index('model:') + 1})"
    )
