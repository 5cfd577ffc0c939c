"""The seed helper API: deepcopy_module_with_process_groups, freeze_module, should_attach_noise."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from nemo_noise_plugin.utils import deepcopy_module_with_process_groups, freeze_module, should_attach_noise
from tests.support.gloo_ranks import run_on_gloo_ranks
from tests.support.models import build_tiny_gpt


def test_plain_deepcopy_of_a_megatron_model_fails_on_its_process_groups(megatron_cpu):
    model = build_tiny_gpt()
    with pytest.raises(TypeError, match="ProcessGroup"):
        copy.deepcopy(model)


def test_deepcopy_shares_process_groups_and_copies_parameters(megatron_cpu):
    model = build_tiny_gpt()
    clone = deepcopy_module_with_process_groups(model)

    assert clone.pg_collection is model.pg_collection
    assert clone.decoder.layers[0].self_attention.pg_collection.tp is model.pg_collection.tp
    for (name, original), (clone_name, copied) in zip(model.named_parameters(), clone.named_parameters(), strict=True):
        assert name == clone_name
        assert copied is not original and copied.data_ptr() != original.data_ptr()
        assert torch.equal(copied, original)
    with torch.no_grad():
        clone.embedding.word_embeddings.weight.add_(1.0)
    assert not torch.equal(clone.embedding.word_embeddings.weight, model.embedding.word_embeddings.weight)


@dataclasses.dataclass
class _GroupHolder:
    group: object
    others: list


def test_deepcopy_finds_groups_in_containers_dataclasses_and_configs(megatron_cpu):
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    module = torch.nn.Linear(2, 2)
    module.groups_list = [tp_group]
    module.groups_dict = {"dp": dp_group}
    module.groups_tuple = ((tp_group,),)
    module.holder = _GroupHolder(group=dp_group, others=[{"nested": tp_group}])

    clone = deepcopy_module_with_process_groups(module)

    assert clone.groups_list[0] is tp_group and clone.groups_list is not module.groups_list
    assert clone.groups_dict["dp"] is dp_group
    assert clone.groups_tuple[0][0] is tp_group
    assert clone.holder is not module.holder and clone.holder.group is dp_group
    assert clone.holder.others[0]["nested"] is tp_group
    assert clone.weight.data_ptr() != module.weight.data_ptr()


def test_freeze_module_disables_every_parameter_in_place(megatron_cpu):
    model = build_tiny_gpt()
    parameters_before = list(model.parameters())
    freeze_module(model)
    assert all(not p.requires_grad for p in model.parameters())
    assert all(a is b for a, b in zip(parameters_before, model.parameters(), strict=True))


def test_should_attach_noise_without_distributed_and_without_megatron():
    """The copy/freeze helpers work with megatron-core hidden; should_attach_noise answers True uninitialised."""
    script = textwrap.dedent(
        """
        import sys, importlib.abc

        class HideMegatron(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "megatron" or name.startswith("megatron."):
                    raise ModuleNotFoundError(f"No module named {name!r} (hidden by test)")
                return None

        sys.meta_path.insert(0, HideMegatron())
        import torch
        from nemo_noise_plugin.utils import (
            deepcopy_module_with_process_groups, freeze_module, should_attach_noise)
        module = torch.nn.Sequential(torch.nn.Linear(3, 3))
        clone = deepcopy_module_with_process_groups(module)
        assert clone[0].weight.data_ptr() != module[0].weight.data_ptr()
        freeze_module(clone)
        assert not any(p.requires_grad for p in clone.parameters())
        assert all(p.requires_grad for p in module.parameters())
        assert should_attach_noise(None) is True and should_attach_noise(3) is True
        assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("OK")


def _attach_decisions(rank: int, world_size: int, port: int, virtual_size: int | None) -> dict:
    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(
        rank=rank,
        world_size=world_size,
        port=port,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=virtual_size,
    )
    try:
        if virtual_size is None:
            return {"none": should_attach_noise(None)}
        decisions = {stage: should_attach_noise(stage) for stage in range(virtual_size)}
        try:
            should_attach_noise(None)
        except ValueError as error:
            decisions["missing_vp_stage_error"] = str(error)
        return decisions
    finally:
        destroy_cpu_parallel()


@pytest.mark.multiprocess
def test_should_attach_noise_only_on_the_first_pipeline_stage():
    first, second = run_on_gloo_ranks(_attach_decisions, 2, None)
    assert first == {"none": True}
    assert second == {"none": False}


@pytest.mark.multiprocess
def test_should_attach_noise_only_on_virtual_stage_zero_of_the_first_rank():
    first, second = run_on_gloo_ranks(_attach_decisions, 2, 2)
    assert (first[0], first[1], second[0], second[1]) == (True, False, False, False)
    assert "vp_stage" in first["missing_vp_stage_error"]
    assert "virtual_pipeline_model_parallel_size=2" in first["missing_vp_stage_error"]
