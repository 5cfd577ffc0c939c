"""Inference-time embedding noise on Hugging Face transformers models: serve or audit under the training noise.

A model trained with the plugin saw its decoder input as ``embedding(x) + z``, with ``z`` drawn by the noise layer
(``noise/layer.py``) from Philox streams keyed by ``(seed, iteration, sample, token position, hidden index)``. This
module gives a transformers model (``LlamaForCausalLM`` and any ``PreTrainedModel`` with ``get_input_embeddings``)
the same noise: ``noised_inputs_embeds`` for whole sequences, ``EmbeddingNoiseHook`` / ``inference_noise`` for
``model(...)`` and ``model.generate(...)`` with a KV cache. Both run the unmodified noise layer (token selection,
clipping, each family's scale, the samplers, the fused kernel on CUDA); only where the tokens sit is inference's own.

Conventions (``docs/noise.md``, "Inference-time noise"):

- Sample ``j`` is row ``j`` of the batch the model is given; the token position of a real token is the number of
  real tokens before it in its row (``attention_mask`` 1; the ``position_ids`` transformers' ``generate`` derives),
  so a left-padded row gets exactly the noise training gives the same tokens right-padded; padding
  (``attention_mask`` 0) is never noised.
- The hook keys a query by one iteration: a forward with an empty cache starts a query at the next iteration, and
  the forwards that continue its cache reuse it, so the token fed at cache position ``p`` gets the noise of
  position ``p`` of the whole sequence, and every ``generate()`` call or plain forward batch gets fresh noise.
- NEFTune's ``1/sqrt(L d)`` needs the length of the whole sequence: ``noised_inputs_embeds`` takes ``L`` from the
  whole sequences it is given (as training does); the hook, whose sequences grow while tokens are cached, refuses
  ``scaling='true_length'``/``'padded_length'``.
- ``tokens='spans'`` noises the tokens of a private mask given per call (``private_mask=`` of
  ``noised_inputs_embeds``, ``EmbeddingNoiseHook.private_mask`` per query), with training's noise for them.
- ``training_only`` is a training switch and is ignored here: asking for inference noise adds it in eval mode.

Imports torch and the ``noise`` package only; transformers is never imported (the models are duck-typed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.noise import hf_inputs
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.noise.geometry import LocalLayout, NoiseBatchInputs, TokenGeometry
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.projection import project_noised
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.validation import check_int

__all__ = ["EmbeddingNoiseHook", "inference_noise", "noised_inputs_embeds"]

_LENGTH_DEPENDENT_SCALINGS = ("true_length", "padded_length")
_MAX_UINT32 = 2**32 - 1


class _PlacedNoise(EmbeddingNoise):
    """The plugin's noise layer on one row's real tokens, at the token positions inference gives them.

    One process and no groups (like the privacy audit's layer); ``geometry`` is the only override, so selection,
    clipping, scales and sampling are the layer's own. Called with microbatch ``j`` of size 1, so the row's global
    sample index is ``j``.
    """

    def __init__(self, config: NoiseConfig, placed: TokenGeometry) -> None:
        super().__init__(config, sequence_parallel=False, pg_collection=None, megatron_groups=False)
        self.placed = placed

    def geometry(self, decoder_input: torch.Tensor, batch: NoiseBatchInputs, layout: LocalLayout) -> TokenGeometry:
        """The placed geometry: positions ``first_position + k`` for the row's ``k``-th real token."""
        return self.placed


def _noise_rows(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    config: NoiseConfig,
    *,
    real: torch.Tensor,
    first_position: torch.Tensor,
    response: torch.Tensor | None,
    padded_length: int,
    iteration: int,
    embedding: torch.nn.Module,
    private: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, s, h]`` embeddings with the noise layer's noise on each row's real tokens (padding left as it is).

    Row ``j``'s real tokens (``real``, in order) sit at token positions ``first_position[j] + 0, 1, ...`` of sample
    ``j``; their sequence length is their count (``true_length``) or ``padded_length`` (``padded_length``). With
    ``projection='nearest_row'`` each noised token is then replaced by its nearest row of ``embedding``'s table.
    ``private`` (``[b, s]``) marks the private-span tokens for ``tokens='spans'``.
    """
    if not config.is_active_configuration:
        return embeds
    out, noised = embeds.clone(), torch.zeros(real.shape, dtype=torch.bool, device=embeds.device)
    for row in range(embeds.size(0)):
        columns = real[row].nonzero().view(-1)
        count = columns.numel()
        if count == 0:
            continue
        device = embeds.device
        placed = TokenGeometry(
            rows=torch.arange(count, device=device, dtype=torch.int64),
            positions=int(first_position[row]) + torch.arange(count, device=device, dtype=torch.int64),
            valid=torch.ones(count, 1, dtype=torch.bool, device=device),
            lengths=torch.full((count, 1), float(count), device=device),
            response=None if response is None else response[row, columns].view(count, 1),
            global_length=padded_length,
            private=None if private is None else private[row, columns].view(count, 1),
        )
        batch = NoiseBatchInputs(input_ids=input_ids[row, columns].view(1, count))
        clock = NoiseClock(iteration=iteration, microbatch=row)
        placed_noise = _PlacedNoise(config, placed).noise_and_selection(embeds[row, columns].unsqueeze(1), batch, clock)
        out[row, columns], noised[row, columns] = placed_noise[0].squeeze(1), placed_noise[1].squeeze(1)
    return out if config.projection == "none" else project_noised(out, noised, embedding, config).decoder_input


def noised_inputs_embeds(
    model: Any,
    input_ids: torch.Tensor,
    noise_config: NoiseConfig,
    *,
    attention_mask: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    iteration: int = 0,
    position_offset: int | torch.Tensor = 0,
    private_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[b, s, h]`` ``inputs_embeds`` training would feed for ``input_ids``: the model's lookup plus the noise.

    Looks ``input_ids`` up with ``model.get_input_embeddings()`` and adds the noise the plugin's Megatron noise layer
    gives the same tokens at ``iteration``: row ``j`` is sample ``j``, and a real token's position is
    ``position_offset`` plus the number of real tokens before it in its row, so right and left padding give the
    same noise to the same tokens; padding (``attention_mask`` 0) is returned as looked up. On CPU the result equals
    the Megatron decoder input (``privacy.audit.noised.noised_embeddings``) bit for bit. Length-scaled noise
    (``scaling='true_length'``/``'padded_length'``) takes ``L`` from these whole sequences: each row's real-token
    count, or the padded width ``s``, as training does. ``training_only`` is ignored (this is a request for noise).

    Example::

        from nemo_noise_plugin.noise.config import NoiseConfig
        from nemo_noise_plugin.noise.hf_inference import noised_inputs_embeds

        config = NoiseConfig(mechanism="gaussian_mechanism", epsilon=8.0, clip_norm=1.0, seed=1234)
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        embeds = noised_inputs_embeds(model, batch.input_ids, config, attention_mask=batch.attention_mask)
        logits = model(inputs_embeds=embeds, attention_mask=batch.attention_mask).logits

    Args:
        model: a transformers model with ``get_input_embeddings()`` (e.g. ``LlamaForCausalLM``).
        input_ids: ``[b, s]`` integer token ids.
        noise_config: the ``NoiseConfig`` the model was trained with.
        attention_mask: ``[b, s]``, 1 for real tokens and 0 for padding (left or right); None: all real.
        loss_mask: ``[b, s]``, the training loss mask (a token is a response token when the loss mask at the real
            token before it is set); needed for ``tokens='prompt'``/``'response'``.
        iteration: the noise iteration (the Philox key and the schedule's iteration), an integer in [0, 2**32).
        position_offset: the token position of each row's first real token (an int, or a ``[b]`` integer tensor),
            for tokens that continue a sequence: the result then equals the whole sequence's at those positions.
        private_mask: ``[b, s]``, True for tokens inside a private span (training's ``private_mask``); needed for
            ``tokens='spans'``, which noises only those.

    Returns:
        ``[b, s, h]`` embeddings in the embedding's dtype, on its device.
    """
    hf_inputs.check_noise_config(noise_config)
    embedding = hf_inputs.input_embeddings(model)
    hf_inputs.check_input_ids(input_ids, embedding)
    real = hf_inputs.check_mask("attention_mask", attention_mask, input_ids)
    hf_inputs.check_mask("loss_mask", loss_mask, input_ids)
    check_int("iteration", iteration, maximum=_MAX_UINT32)
    first_position = hf_inputs.first_positions(position_offset, input_ids)
    resumes = bool((first_position > 0).any())
    family = noise_family(noise_config.mechanism)
    if resumes and family.length_scaled and noise_config.scaling in _LENGTH_DEPENDENT_SCALINGS:
        raise ValueError(
            f"position_offset={hf_inputs.shown(position_offset)} is invalid with NoiseConfig.scaling="
            f"{noise_config.scaling!r}: the NEFTune factor 1/sqrt(L d) needs the whole sequence's length L. "
            "Expected position_offset=0 (pass whole sequences) or scaling='absolute'/'embedding_distance'."
        )
    response, private = hf_inputs.token_parts(
        noise_config, real, loss_mask, private_mask, position_offset, resumes=resumes
    )
    embeds = embedding(input_ids)
    return _noise_rows(
        embeds,
        input_ids,
        noise_config,
        real=real.to(embeds.device),
        first_position=first_position,
        response=None if response is None else response.to(embeds.device),
        padded_length=input_ids.size(1),
        iteration=iteration,
        embedding=embedding,
        private=None if private is None else private.to(embeds.device),
    )


@dataclass
class _Query:
    """One query of the hook: its noise iteration and the width of its first forward (the prompt)."""

    iteration: int
    prompt_width: int


@dataclass
class _Forward:
    """What the lookup inside one forward needs: which tokens are real, where each row's first one sits."""

    real: torch.Tensor
    first_position: torch.Tensor
    response: torch.Tensor | None
    iteration: int
    private: torch.Tensor | None = None


class EmbeddingNoiseHook:
    """Adds the plugin's noise to every input embedding a transformers model looks up, KV-cache decoding included.

    ``attach(model)`` registers a forward pre-hook on ``model.base_model`` (the module whose forward looks the ids
    up; it reads ``attention_mask`` and ``past_key_values``) and a forward hook on ``model.get_input_embeddings()``
    that returns the noised lookup; ``detach()`` removes both. It holds no tensors between queries but the current
    query's iteration, and keeps no reference to the model once detached.

    Per forward: the tokens fed after ``past_key_values.get_seq_length()`` cached ones get the noise that
    ``noised_inputs_embeds`` gives the whole sequence (cached plus new, with the whole 2-D ``attention_mask``) at
    their positions; row ``j`` is sample ``j``; padding is never noised. A forward with an empty cache starts a
    query: the next iteration (``iteration``, ``iteration + 1``, ...), so each ``generate()`` call or uncached
    forward batch gets fresh noise and the same seed and start reproduce it. ``tokens='prompt'``/``'response'``:
    a query's first forward is its prompt, every token fed after it is response (a training loss mask that carries
    loss from the prompt's last token on). ``tokens='spans'``: set ``hook.private_mask`` (``[b, w]``, True inside a
    private span, over the columns of the whole 2-D sequence, as ``attention_mask``) before each query; columns past
    its width (generated tokens) are not private. ``inputs_embeds`` passed by the caller are used as given.

    Not covered: the NEFTune length scalings (refused: a cached token's noise cannot change as the sequence grows),
    4-D attention masks (static caches), chunked prefill under ``tokens='prompt'``/``'response'``, and beam search,
    whose rows are reassigned between steps (a beam keeps the noise of the rows its cached tokens were fed in).

    Example::

        from nemo_noise_plugin.noise.config import NoiseConfig
        from nemo_noise_plugin.noise.hf_inference import EmbeddingNoiseHook

        hook = EmbeddingNoiseHook(NoiseConfig(mechanism="metric_dp", eta=50.0, clip_norm=1.0)).attach(model)
        out = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=32)
        hook.detach()

    Args:
        noise_config: the ``NoiseConfig`` the model was trained with (``scaling`` not ``true_length`` or
            ``padded_length`` for uniform and gaussian noise).
        iteration: the first query's noise iteration (Philox key and schedule iteration), in [0, 2**32).
    """

    def __init__(self, noise_config: NoiseConfig, *, iteration: int = 0) -> None:
        hf_inputs.check_noise_config(noise_config)
        check_int("iteration", iteration, maximum=_MAX_UINT32)
        family = noise_family(noise_config.mechanism)
        if family.length_scaled and noise_config.scaling in _LENGTH_DEPENDENT_SCALINGS:
            raise ValueError(
                f"NoiseConfig.scaling={noise_config.scaling!r} is invalid for EmbeddingNoiseHook with mechanism="
                f"{noise_config.mechanism!r}: the NEFTune factor 1/sqrt(L d) depends on the whole sequence's "
                "length, which grows while tokens are cached, so a cached token's noise would have to change. "
                "Expected scaling='absolute' or 'embedding_distance', or noised_inputs_embeds on whole sequences."
            )
        self.noise_config = noise_config
        self.next_iteration = iteration
        """The iteration the next query gets."""
        self.private_mask: torch.Tensor | None = None
        """``tokens='spans'``: ``[b, w]`` True for the private-span tokens of the queries to come (set per query)."""
        self._query: _Query | None = None
        self._forward: _Forward | None = None
        self._handles: list[Any] = []
        self._model_name = ""

    @property
    def iteration(self) -> int | None:
        """The current (last started) query's iteration, or None before the first."""
        return None if self._query is None else self._query.iteration

    @property
    def attached(self) -> bool:
        """True while the hook is attached to a model."""
        return bool(self._handles)

    def attach(self, model: Any) -> EmbeddingNoiseHook:
        """Noise ``model``'s input embeddings from now on; returns the hook."""
        if self.attached:
            raise ValueError(f"EmbeddingNoiseHook is already attached to {self._model_name}: detach() it first.")
        embedding = hf_inputs.input_embeddings(model)
        base = getattr(model, "base_model", model)
        if not isinstance(base, torch.nn.Module):
            raise ValueError(
                f"model={type(model).__name__} is invalid: expected a torch module (a transformers PreTrainedModel) "
                f"whose base_model is a module, got base_model of type {type(base).__name__}."
            )
        self._model_name = type(model).__name__
        self._handles = [
            base.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            embedding.register_forward_hook(self._after_lookup),
        ]
        return self

    def detach(self) -> None:
        """Remove the hooks; the model looks its embeddings up clean again."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._forward = [], None

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Place the tokens of this forward: which are real, the position of each row's first, the query."""
        named = hf_inputs.named_arguments(module, args, kwargs)
        input_ids = named.get("input_ids")
        past = hf_inputs.cached_length(named.get("past_key_values"))
        if past == 0 or self._query is None:
            width = 0 if input_ids is None else input_ids.size(-1)
            self._query = _Query(iteration=self.next_iteration, prompt_width=past + width)
            self.next_iteration += 1
        if input_ids is None:
            self._forward = None
            return
        batch, width = input_ids.shape
        mask = named.get("attention_mask")
        if mask is None:
            real = torch.ones(batch, width, dtype=torch.bool, device=input_ids.device)
            first_position = torch.full((batch,), past, dtype=torch.int64)
        else:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, past + width):
                raise ValueError(
                    f"attention_mask has shape {hf_inputs.shape_of(mask)}: EmbeddingNoiseHook expected the 2-D mask of "
                    f"the whole sequence, [batch, cached + new] = [{batch}, {past} + {width}] (1 real, 0 padding); "
                    "static caches' 4-D masks are not supported."
                )
            mask = mask.bool()
            real = mask[:, past:]
            first_position = mask[:, :past].sum(dim=1).to(device="cpu", dtype=torch.int64)
        response = None
        if self.noise_config.tokens in ("prompt", "response"):
            columns = past + torch.arange(width, device=input_ids.device)
            response = (columns >= self._query.prompt_width).view(1, -1).expand(batch, width)
        private = hf_inputs.private_columns(self.noise_config, self.private_mask, batch, past, width, input_ids.device)
        self._forward = _Forward(real, first_position, response, self._query.iteration, private)

    def _after_lookup(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        """The looked-up ``[b, s, h]`` embeddings with this forward's noise."""
        placed, self._forward = self._forward, None
        if placed is None:
            raise RuntimeError(
                f"EmbeddingNoiseHook: {self._model_name}'s input embedding was looked up outside a forward of the "
                "model it is attached to (e.g. by noised_inputs_embeds, which would noise twice): detach() the hook "
                "first, or call the model itself."
            )
        input_ids = inputs[0]
        if tuple(output.shape[:2]) != tuple(placed.real.shape):
            raise ValueError(
                f"EmbeddingNoiseHook: the lookup returned {list(output.shape)} for a forward of "
                f"{list(placed.real.shape)} tokens: expected one lookup of the forward's input_ids."
            )
        return _noise_rows(
            output,
            input_ids,
            self.noise_config,
            real=placed.real.to(output.device),
            first_position=placed.first_position,
            response=None if placed.response is None else placed.response.to(output.device),
            padded_length=output.size(1),
            iteration=placed.iteration,
            embedding=module,
            private=None if placed.private is None else placed.private.to(output.device),
        )


@contextlib.contextmanager
def inference_noise(model: Any, noise_config: NoiseConfig, *, iteration: int = 0) -> Iterator[EmbeddingNoiseHook]:
    """Noise ``model``'s input embeddings inside the block (an attached ``EmbeddingNoiseHook``, yielded).

    Example::

        from nemo_noise_plugin.noise.hf_inference import inference_noise

        with inference_noise(model, noise_config, iteration=10_000) as hook:
            first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=16)
            second = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=16)  # fresh noise
        # hook.iteration == 10_001; the model is clean again

    Args:
        model: a transformers model with ``get_input_embeddings()`` and ``base_model``.
        noise_config: the ``NoiseConfig`` the model was trained with (see ``EmbeddingNoiseHook``).
        iteration: the first query's noise iteration.
    """
    hook = EmbeddingNoiseHook(noise_config, iteration=iteration).attach(model)
    try:
        yield hook
    finally:
        hook.detach()
