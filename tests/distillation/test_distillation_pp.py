"""Clean-teacher distillation under pipeline parallelism equals the unsplit (PP=1) run, on four gloo CPU processes.

One spawn of four processes, two layouts, each against PP=1 on the same processes with the same weights and batches:

- PP=2 x VPP=2 x EP=2 (4 layers, one per model chunk, MoE with a dense last layer, bf16 behind ``Float16Module``,
  alltoall dispatcher), through Megatron's ``forward_backward_pipelining_with_interleaving`` on the normal path
  and on the fine-grained schedule plan (``overlap_moe_expert_parallel_comm``);
- PP=2 x DP=2 (4 dense layers, two per stage, float32), through ``forward_backward_pipelining_without_interleaving``;
- the same on Megatron-Core's ``HybridModel`` (``NoisyHybridDistillationProvider``, the pattern ``*-*-*-*-`` split
  as ``*-*-|*-*-``, the local hybrid stack).

The forward step is the plugin's ``distillation_forward_step`` with a Bridge ``GlobalState``, for forward KL (with
a temperature), reverse KL, JSD, top-k forward KL (all with NEFTune noise on response tokens) and forward KL without
noise. The PP=2 runs have DP=2 and 4 microbatches of 2 samples per data-parallel rank; the reference has DP=4 and 2
microbatches, and its rank r holds microbatches r//2 and r//2 + 2 of data-parallel rank r%2. That places every
sample at the same global index (so it gets the same noise) and in the same expert-parallel group, so the
reference's losses per microbatch are the PP=2 run's, and the sum of its gradients over ranks r and r+2 is the PP=2
gradient of data-parallel rank r%2.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.gloo_ranks import run_on_gloo_ranks

pytestmark = pytest.mark.slow  # minutes on 2 cores: run by `make test` after the main suite

MICROBATCHES, MICRO_BATCH_SIZE = 4, 2
CASES = ("forward_kl", "reverse_kl", "jsd", "top_k", "clean")
KD_FLOOR = {"pp2_vpp2_ep2": 1e-4, "pp2_dp2": 1e-4, "hybrid_pp2_dp2": 1e-5}
"""The smallest KD loss a case with noise (or after the student's update) may show: the noise makes the student
differ from its teacher. The hybrid stack (local spec, no final norm) shows 5e-5-5e-4 at alpha 10, GPT over 1e-4."""
UPDATE_STEP = len(CASES)  # after the compared cases: one SGD step on the student, then one more KD step


def _kd_case(name: str):
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

    noise = NoiseConfig(alpha=10.0, tokens="response")
    return {
        "forward_kl": (KDConfig(loss="forward_kl", temperature=2.0, kd_weight=0.5), noise),
        "reverse_kl": (KDConfig(loss="reverse_kl"), noise),
        "jsd": (KDConfig(loss="jsd", jsd_beta=0.3), noise),
        "top_k": (KDConfig(loss="forward_kl", top_k=8), noise),
        "clean": (KDConfig(loss="forward_kl"), NoiseConfig(enabled=False)),
    }[name]


def _set_case(provider, chunks, name: str) -> None:
    """Switch the KD settings (read from the shared config) and the noise of the noisy chunk; clear gradients."""
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.model import NoiseInjectionMixin

    provider.kd, noise = _kd_case(name)
    for chunk in chunks:
        inner = unwrap_model(chunk)
        if isinstance(inner, NoiseInjectionMixin):
            inner.init_noise(noise)
        for parameter in chunk.parameters():
            parameter.grad = None


def _layouts():
    from tests.support.hybrid_schedule_plan import build_hybrid_provider

    dense = dict(
        num_moe_experts=None, moe_ffn_hidden_size=None, moe_layer_freq=1, moe_token_dispatcher_type="allgather"
    )
    return {
        "pp2_vpp2_ep2": dict(
            parallel=dict(
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2
            ),
            model=dict(
                num_layers=4,
                moe_layer_freq=[1, 1, 1, 0],
                expert_model_parallel_size=2,
                bf16=True,
                params_dtype=torch.bfloat16,
                pipeline_dtype=torch.bfloat16,
                batch_p2p_comm=False,
            ),
            pipeline=dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            paths=(False, True),
        ),
        "pp2_dp2": dict(
            parallel=dict(pipeline_model_parallel_size=2),
            model=dict(num_layers=4, **dense, params_dtype=torch.float32, pipeline_dtype=torch.float32),
            pipeline=dict(pipeline_model_parallel_size=2),
            paths=(False,),
        ),
        "hybrid_pp2_dp2": dict(
            parallel=dict(pipeline_model_parallel_size=2),
            model=dict(
                pattern="*-*-*-*-", **dense, bf16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32
            ),
            pipeline=dict(pipeline_model_parallel_size=2, pattern="*-*-|*-*-"),
            paths=(False,),
            provider=build_hybrid_provider,
            update_lr=50.0,  # at 0.5 the student moves too little for the KD check (~1e-7); at 50: 2e-4-5e-4
        ),
    }


def _provider(layout: dict, *, pipelined: bool, **settings):
    """The layout's finalized distillation provider (GPT unless the layout names another builder), with the
    clean case's KD settings: the reference's (unsplit) or the pipelined run's settings."""
    from tests.support.schedule_plan import build_provider

    build = layout.get("provider", build_provider)
    model = {**layout["model"], **(layout["pipeline"] if pipelined else {})}
    return build(*reversed(_kd_case("clean")), share_embeddings_and_output_weights=False, **settings, **model)


def _build(provider):
    from megatron.core.transformer.module import Float16Module

    return provider.provide_distributed_model(
        use_cpu_initialization=True,
        wrap_with_ddp=False,
        mixed_precision_wrapper=Float16Module if provider.bf16 else None,
    )


def _reference(rank: int, world_size: int, port: int, layout: dict, batches: dict) -> dict:
    """PP=1, DP=4: this rank's reports and gradients per case, and its initial weights."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from nemo_noise_plugin.jobs.cpu.parallel import init_cpu_parallel
    from nemo_noise_plugin.training.forward_step import distillation_forward_step
    from tests.support.schedule_plan import bound_forward_step, bridge_state, run_normal_path

    expert = layout["parallel"].get("expert_model_parallel_size", 1)
    init_cpu_parallel(rank=rank, world_size=world_size, port=port, expert_model_parallel_size=expert)
    init_num_microbatches_calculator(rank, None, MICROBATCHES * MICRO_BATCH_SIZE * 2, MICRO_BATCH_SIZE, 4)
    try:
        provider = _provider(layout, pipelined=False)
        torch.manual_seed(3)
        (model,) = _build(provider)
        weights = {name: None if t is None else t.clone() for name, t in model.state_dict().items()}
        dp_rank, half = rank % 2, rank // 2
        mine = [batches[dp_rank][half], batches[dp_rank][half + 2]]
        results = {}
        for step, name in enumerate(CASES):
            _set_case(provider, [model], name)
            state = bridge_state(provider, MICROBATCHES * MICRO_BATCH_SIZE * 2, MICRO_BATCH_SIZE, step=step)
            results[name] = run_normal_path(bound_forward_step(distillation_forward_step, state), model, mine)
        return {"weights": weights, "results": results}
    finally:
        destroy_num_microbatches_calculator()


def _pipelined(rank: int, world_size: int, port: int, layout: dict, batches: dict, weights: dict) -> dict:
    """PP=2 (normal path, and the plan where the layout has it) from the reference's weights, every case."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.distillation.pipeline_teacher import attached_teacher_pipe
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher
    from nemo_noise_plugin.jobs.cpu.parallel import init_cpu_parallel
    from nemo_noise_plugin.model import NoiseInjectionMixin
    from nemo_noise_plugin.training.forward_step import distillation_forward_step
    from tests.support.schedule_plan import (
        PathResult,
        bridge_state,
        global_gradients,
        global_layer_name,
        load_from_unsplit,
        run_interleaved,
    )

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, **layout["parallel"])
    data_parallel = parallel_state.get_data_parallel_world_size()
    assert data_parallel == 2
    global_batch = MICROBATCHES * MICRO_BATCH_SIZE * data_parallel
    init_num_microbatches_calculator(rank, None, global_batch, MICRO_BATCH_SIZE, data_parallel)
    dp_rank = parallel_state.get_data_parallel_rank()
    out: dict = {"pp rank": parallel_state.get_pipeline_model_parallel_rank(), "dp rank": dp_rank, "paths": {}}
    try:
        for overlap in layout["paths"]:
            provider = _provider(layout, pipelined=True, overlap_moe_expert_parallel_comm=overlap)
            chunks = _build(provider)
            for chunk in chunks:
                load_from_unsplit(chunk, weights)
            teachers = [attached_teacher(chunk) for chunk in chunks]
            teacher_calls = [0] * len(chunks)
            for index, teacher in enumerate(teachers):
                teacher.register_forward_hook(
                    lambda *_, _index=index, _calls=teacher_calls: _calls.__setitem__(_index, _calls[_index] + 1)
                )
            clean_probe = _CleanInputProbe(chunks, teachers) if not overlap else None
            results, calls = {}, {}
            for step, name in enumerate(CASES):
                _set_case(provider, chunks, name)
                teacher_calls[:] = [0] * len(chunks)
                if clean_probe is not None:
                    clean_probe.arm(name == "forward_kl")
                state = bridge_state(provider, global_batch, MICRO_BATCH_SIZE, step=step)
                result = run_interleaved(chunks, batches[dp_rank], state, forward_step=distillation_forward_step)
                results[name] = PathResult(result.reports, global_gradients(chunks))
                calls[name] = list(teacher_calls)
                attached_teacher_pipe(chunks[0]).wait_all()
            # A training step on the student (SGD on the clean case's gradients), then one more KD step: the
            # teacher keeps the loaded weights bit for bit, and the student now differs from it without noise.
            with torch.no_grad():
                for chunk in chunks:
                    for parameter in chunk.parameters():
                        if parameter.grad is not None:
                            parameter.add_(parameter.grad, alpha=-layout.get("update_lr", 0.5))
            _set_case(provider, chunks, "clean")
            state = bridge_state(provider, global_batch, MICRO_BATCH_SIZE, step=UPDATE_STEP)
            after_update = run_interleaved(chunks, batches[dp_rank], state, forward_step=distillation_forward_step)
            attached_teacher_pipe(chunks[0]).wait_all()
            noisy = []
            for vp_stage, chunk in enumerate(chunks):
                inner = unwrap_model(chunk)
                if isinstance(inner, NoiseInjectionMixin):
                    inner.init_noise(_kd_case("forward_kl")[1])  # the noise of the noise cases, to see where it is
                    if inner.noise_active:
                        noisy.append(vp_stage)
            unwrapped = {name.removeprefix("module."): tensor for name, tensor in weights.items()}
            teacher_unchanged = all(
                torch.equal(tensor, unwrapped[global_layer_name(chunk, name)])
                for chunk, teacher in zip(chunks, teachers, strict=True)
                for name, tensor in teacher.state_dict().items()
                if tensor is not None
            )
            student_moved = any(
                not torch.equal(tensor, unwrapped[global_layer_name(chunk, name)])
                for chunk in chunks
                for name, tensor in unwrap_model(chunk).state_dict().items()
                if tensor is not None
            )
            out["paths"]["plan" if overlap else "normal"] = {
                "results": results,
                "teacher calls": calls,
                "noisy chunks": noisy,
                "teacher frozen": all(not p.requires_grad for t in teachers for p in t.parameters()),
                "teacher unchanged": teacher_unchanged,
                "student moved": student_moved,
                "after update": after_update.reports,
                "clean probe": clean_probe.seen if clean_probe is not None else None,
            }
        return out
    finally:
        destroy_num_microbatches_calculator()


class _CleanInputProbe:
    """On the noisy chunk: the student's embedding output, the student's and the teacher's decoder inputs."""

    def __init__(self, chunks, teachers) -> None:
        from megatron.core.utils import unwrap_model

        from nemo_noise_plugin.model import NoiseInjectionMixin

        self.armed, self.seen = False, {}
        for chunk, teacher in zip(chunks, teachers, strict=True):
            inner = unwrap_model(chunk)
            if isinstance(inner, NoiseInjectionMixin):
                inner.register_forward_pre_hook(self._keep_lookup(inner), with_kwargs=True)
                inner.embedding.register_forward_hook(self._keep("embedding"))
                inner.decoder.register_forward_pre_hook(self._keep_input("student decoder"), with_kwargs=True)
                teacher.decoder.register_forward_pre_hook(self._keep_input("teacher decoder"), with_kwargs=True)

    def arm(self, on: bool) -> None:
        self.armed = on

    def _keep(self, key):
        def hook(module, args, output):
            if self.armed and key not in self.seen:
                self.seen[key] = output.detach().float().clone()

        return hook

    def _keep_lookup(self, inner):
        """The clean embedding where the student adds its noise in the lookup (model/noised_lookup.py) and so never
        calls its embedding module: the looked-up rows in [s, b, h]."""
        from nemo_noise_plugin.model.noised_lookup import lookup_fusion_blocker

        def hook(module, args, kwargs):
            if not self.armed or "embedding" in self.seen or not inner.noise_active:
                return
            if lookup_fusion_blocker(inner) is None:
                input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
                weight = inner.embedding.word_embeddings.weight.detach()
                self.seen["embedding"] = weight[input_ids].transpose(0, 1).float().clone()

        return hook

    def _keep_input(self, key):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if self.armed and key not in self.seen:
                self.seen[key] = hidden.detach().float().clone()

        return hook


def _four_ranks(rank: int, world_size: int, port: int) -> dict:
    from nemo_noise_plugin.jobs.cpu.parallel import destroy_cpu_parallel
    from tests.support.attention_variables import clean_attention_variables
    from tests.support.schedule_plan import microbatches
    from tests.support.schedule_plan_substitutes import install_schedule_plan_substitutes

    install_schedule_plan_substitutes()
    batches = {dp: microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=100 + dp) for dp in range(2)}
    out = {}
    try:
        for name, layout in _layouts().items():
            started = time.perf_counter()
            with clean_attention_variables():  # each layout's attention backend (the hybrid one's is local)
                reference = _reference(rank, world_size, port, layout, batches)
                middle = time.perf_counter()
                pipelined = _pipelined(rank, world_size, port, layout, batches, reference["weights"])
            elapsed = time.perf_counter() - middle
            print(f"rank {rank} {name}: reference {middle - started:.0f} s, pipelined {elapsed:.0f} s")
            weights_digest = {
                key: float(value.double().sum()) for key, value in reference["weights"].items() if value is not None
            }
            out[name] = {"reference": reference["results"], "weights": weights_digest, **pipelined}
        return out
    finally:
        destroy_cpu_parallel()


@pytest.fixture(scope="module")
def ranks():
    return run_on_gloo_ranks(_four_ranks, 4, timeout=1500)


def _expected_report(ranks, layout: str, case: str, dp_rank: int, microbatch: int):
    return ranks[dp_rank + 2 * (microbatch % 2)][layout]["reference"][case].reports[microbatch // 2]


def _value(report, key: str) -> float:
    return float(report[key][0] / report[key][1])


@pytest.mark.parametrize(("layout", "rtol"), [("pp2_vpp2_ep2", 1e-2), ("pp2_dp2", 1e-5), ("hybrid_pp2_dp2", 1e-5)])
def test_pipelined_losses_and_gradients_equal_the_unsplit_run(ranks, layout, rtol):
    for rank in range(4):
        assert ranks[rank][layout]["weights"] == ranks[(rank + 2) % 4][layout]["weights"]  # same model everywhere
    for result in ranks:
        result = result[layout]
        dp_rank = result["dp rank"]
        for path, outcome in result["paths"].items():
            for case in CASES:
                reports = outcome["results"][case].reports
                assert len(reports) == (MICROBATCHES if result["pp rank"] == 1 else 0)
                for microbatch, report in enumerate(reports):
                    expected = _expected_report(ranks, layout, case, dp_rank, microbatch)
                    assert sorted(report) == sorted(expected)
                    for key in report:
                        torch.testing.assert_close(
                            report[key],
                            expected[key],
                            rtol=rtol,
                            atol=1e-5,
                            msg=lambda m, label=f"{layout} {path} {case} mb {microbatch} {key}": f"{label}: {m}",
                        )
                    if case != "clean":
                        assert _value(report, "kd loss") > KD_FLOOR[layout]  # the noise makes the student differ
                    else:  # no noise, teacher = student: nothing to distil
                        assert abs(_value(report, "kd loss")) < 1e-6
                grads = outcome["results"][case].grads
                reference = [
                    ranks[dp_rank][layout]["reference"][case].grads,
                    ranks[dp_rank + 2][layout]["reference"][case].grads,
                ]
                assert grads and set(grads) <= set(reference[0])
                # Megatron scales each microbatch's loss by 1/num_microbatches: 1/2 in the reference, 1/4 here.
                scale = max(g.abs().max().item() for g in reference[0].values()) / 2
                for name, grad in grads.items():
                    expected = (reference[0][name] + reference[1][name]) / 2
                    torch.testing.assert_close(
                        grad,
                        expected,
                        rtol=rtol,
                        atol=rtol * scale,
                        msg=lambda m, label=f"{layout} {path} {case} {name}": f"{label}: {m}",
                    )
        covered = set().union(*(set(r[layout]["paths"]["normal"]["results"]["jsd"].grads) for r in ranks))
        assert covered == set(ranks[0][layout]["reference"]["jsd"].grads)  # every parameter is compared somewhere


@pytest.mark.parametrize("layout", ["pp2_vpp2_ep2", "pp2_dp2", "hybrid_pp2_dp2"])
def test_the_teacher_runs_once_per_microbatch_and_chunk_and_stays_frozen(ranks, layout):
    for result in ranks:
        for path, outcome in result[layout]["paths"].items():
            for case in CASES:
                chunks = len(outcome["teacher calls"][case])
                assert outcome["teacher calls"][case] == [MICROBATCHES] * chunks, (path, case)
            assert outcome["teacher frozen"] and outcome["teacher unchanged"] and outcome["student moved"], path
            if result[layout]["pp rank"] == 1:  # after the student's update, without noise: the teacher differs
                assert all(_value(report, "kd loss") > KD_FLOOR[layout] for report in outcome["after update"]), path


@pytest.mark.parametrize("layout", ["pp2_vpp2_ep2", "pp2_dp2", "hybrid_pp2_dp2"])
def test_noise_is_on_one_chunk_and_the_teacher_sees_the_clean_embedding(ranks, layout):
    for path in ranks[0][layout]["paths"]:
        noisy = [
            (r[layout]["pp rank"], r[layout]["dp rank"], chunk)
            for r in ranks
            for chunk in r[layout]["paths"][path]["noisy chunks"]
        ]
        assert sorted(noisy) == [(0, 0, 0), (0, 1, 0)], (path, noisy)
    for result in ranks:
        seen = result[layout]["paths"]["normal"]["clean probe"]
        if result[layout]["pp rank"] != 0:
            assert seen == {}
            continue
        assert torch.equal(seen["teacher decoder"], seen["embedding"])  # the teacher's input: clean
        assert (seen["student decoder"] - seen["embedding"]).abs().max() > 1e-3  # the student's: noised
