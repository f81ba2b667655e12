"""The engine's checks at its edge: prompts, request ids, sampling parameters.

Everything here is pure: a check raises ``TypeError`` (wrong kind of value) or ``ValueError``
(out of range) naming the argument, the value and the limit, or returns a normalised copy. The
engine runs every check of a call before it queues anything, so a refused call changes nothing.
The limits are the context's: request ids are stored in int32 rows where -1 marks a free row,
and each sampling field in the context's per-request metadata dtype
(``context.request_metadata_types``).
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dynctx.context import DynamicInferenceRequest, SamplingParams

REQUEST_ID_LIMIT = 2 ** 31  # ids lie in [0, 2**31): int32 rows, -1 marks a free row

MetadataTypes = Sequence[Tuple[str, torch.dtype, bool]]


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, low: Optional[int] = None,
              high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high]`` (either bound optional); bools are refused."""
    if not _is_int(value):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ValueError(f"{name}={value} must lie in {span}")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` when it is one of ``choices``, else ``ValueError`` naming the option, the value
    and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r} must be one of "
                         f"{', '.join(repr(c) for c in choices)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (numpy's too), else ``TypeError`` naming the option."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool")
    return bool(value)


def check_request_id(name: str, value: Any) -> int:
    return check_int(name, value, low=0, high=REQUEST_ID_LIMIT - 1)


def check_model_and_context(model: Any, context: Any) -> None:
    """``Engine``'s two parts: a model with a callable ``forward(context, last_token_only=)``
    and a ``DynamicInferenceContext``, else ``TypeError`` naming the argument; then the model's
    own ``check_context(context)`` where it has one."""
    from dynctx.context import DynamicInferenceContext

    if not callable(getattr(model, "forward", None)):
        raise TypeError(f"model={model!r} must have a callable forward(context, "
                        "last_token_only=...) (a dynctx.models adapter)")
    if not isinstance(context, DynamicInferenceContext):
        raise TypeError(f"context must be a DynamicInferenceContext, got "
                        f"{type(context).__name__}")
    model_vocab, context_vocab = getattr(model, "vocab_size", None), context.vocab_size
    if model_vocab is not None and context_vocab is not None and model_vocab != context_vocab:
        raise ValueError(f"vocab_size={context_vocab} (the context's) must be the model's "
                         f"vocabulary size, {model_vocab}: every step's logits have that many "
                         "columns")
    if hasattr(model, "check_context"):
        model.check_context(context)


def vocab_limit(*sizes: Optional[int]) -> Optional[int]:
    """The smallest of the known vocabulary sizes (model, context), or None."""
    known = [int(s) for s in sizes if s is not None]
    return min(known) if known else None


def _token_values(prompt: Any, name: str) -> np.ndarray:
    """The token ids of ``prompt`` as int64, refusing what is not a 1-D list of whole numbers."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError(f"{name} is a {type(prompt).__name__}: give token ids (a list of ints "
                        "or a 1-D integer tensor); tokenize text first")
    if isinstance(prompt, (dict, set, frozenset)):
        raise TypeError(f"{name} is a {type(prompt).__name__}: give the token ids in order (a "
                        "list of ints or a 1-D integer tensor)")
    if isinstance(prompt, torch.Tensor):
        if prompt.is_meta:
            raise ValueError(f"{name} is on the meta device: it holds no token ids")
        if prompt.dtype == torch.bool or prompt.is_complex():
            raise TypeError(f"{name} must hold integer token ids, got dtype {prompt.dtype}")
        array = prompt.detach().cpu().numpy()
    elif isinstance(prompt, np.ndarray):
        array = prompt
    elif _is_int(prompt) or isinstance(prompt, numbers.Number):
        raise TypeError(f"{name}={prompt!r} is a single number: a prompt is a list of token ids")
    else:
        try:
            values = list(prompt)
        except TypeError:
            raise TypeError(f"{name} must be a list of token ids, got "
                            f"{type(prompt).__name__}") from None
        for j, value in enumerate(values):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name}[{j}]={value!r} must be an int token id, got "
                                f"{type(value).__name__}")
        array = np.asarray(values, dtype=object) if values else np.zeros(0, dtype=np.int64)
    if array.dtype == np.bool_:
        raise TypeError(f"{name} must hold integer token ids, got booleans")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one prompt of token ids), got shape "
                         f"{tuple(array.shape)}")
    if array.dtype.kind in "iu":
        if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} holds token id {array.max()}, beyond int64")
        return array.astype(np.int64)
    if array.dtype.kind not in "fO":
        raise TypeError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    out = np.empty(array.size, dtype=np.int64)
    for j, value in enumerate(array.tolist()):
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{name}[{j}]={value!r} is not a whole number (a token id)")
        if not -2 ** 63 <= int(value) < 2 ** 63:
            raise ValueError(f"{name}[{j}]={int(value)} is beyond int64")
        out[j] = int(value)
    return out


def prompt_tensor(prompt: Any, name: str, vocab: Optional[int]) -> torch.Tensor:
    """A prompt as a new int64 CPU tensor ``[n]``, ``n >= 1``, every id in ``[0, vocab)``.

    Accepts a list/tuple of ints, a 1-D integer tensor or array, and floats only where every
    value is a whole number."""
    values = _token_values(prompt, name)
    if values.size == 0:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    outside = values < 0
    if vocab is not None:
        outside |= values >= vocab
    bad = np.flatnonzero(outside)
    if bad.size:
        j = int(bad[0])
        limit = "" if vocab is None else f", {vocab}"
        raise ValueError(f"{name}[{j}]={int(values[j])} is outside the vocabulary [0{limit})"
                         + ("" if vocab is None else " (vocab_size)"))
    return torch.from_numpy(values.copy())


def check_sampling_params(params: Any, name: str, metadata_types: MetadataTypes) -> SamplingParams:
    """A copy of ``params`` once every field the engine and the context use is checked."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{name} must be a SamplingParams, got {type(params).__name__}")
    if params.stop_words:
        raise NotImplementedError(f"{name}.stop_words: stop words are not supported by the "
                                  "reference engine")
    if params.top_n_logprobs:
        raise NotImplementedError(f"{name}.top_n_logprobs={params.top_n_logprobs!r}: top-n log "
                                  "probs are not supported by the reference engine")
    temperature = params.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"{name}.temperature={temperature!r} must be a number")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{name}.temperature={temperature!r} must be a finite number >= 0")
    top_p = params.top_p
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"{name}.top_p={top_p!r} must be a number")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"{name}.top_p={top_p!r} must lie in [0, 1]")
    check_int(f"{name}.top_k", params.top_k, low=0)
    if params.seed is not None:
        check_int(f"{name}.seed", params.seed)
    if params.termination_id is not None:
        check_int(f"{name}.termination_id", params.termination_id)
    for flag in ("return_log_probs", "skip_prompt_log_probs"):
        if not isinstance(getattr(params, flag), (bool, np.bool_)):
            raise TypeError(f"{name}.{flag}={getattr(params, flag)!r} must be a bool")
    for label, dtype, _ in metadata_types:
        value = getattr(params, label, None)
        if label == "termination_id" and value is None:
            continue
        if not dtype.is_floating_point and dtype != torch.bool and _is_int(value):
            info = torch.iinfo(dtype)
            if not info.min <= value <= info.max:
                raise ValueError(f"{name}.{label}={value} must lie in [{info.min}, {info.max}] "
                                 f"(the context stores it as {dtype})")
    return copy.copy(params)  # every field the engine reads is a scalar


def generation_budget(params: SamplingParams, prompt_length: int, name: str) -> int:
    """``num_tokens_to_generate`` (from ``num_tokens_total`` when set), an int >= 1."""
    if params.num_tokens_total is not None:
        total = check_int(f"{name}.num_tokens_total", params.num_tokens_total)
        if total <= prompt_length:
            raise ValueError(f"{name}.num_tokens_total={total} must exceed the prompt length "
                             f"({prompt_length})")
        return total - prompt_length
    return check_int(f"{name}.num_tokens_to_generate", params.num_tokens_to_generate, low=1)


def checked_request(request: Any, name: str, *, vocab: Optional[int],
                    metadata_types: MetadataTypes) -> DynamicInferenceRequest:
    """The engine's own copy of ``request`` (prompt, resolved sampling parameters), checked."""
    if not isinstance(request, DynamicInferenceRequest):
        raise TypeError(f"{name} must be a DynamicInferenceRequest, got {type(request).__name__}")
    rid = check_request_id(f"{name}.request_id", request.request_id)
    if request.prompt_tokens is None:
        raise ValueError(f"{name} (request_id={rid}): prompt_tokens is missing")
    prompt = prompt_tensor(request.prompt_tokens, f"{name}.prompt_tokens", vocab)
    params = check_sampling_params(request.sampling_params, f"{name}.sampling_params",
                                   metadata_types)
    params.num_tokens_to_generate = generation_budget(params, len(prompt),
                                                      f"{name}.sampling_params")
    salt = request.prefix_caching_salt
    if salt is not None and (isinstance(salt, bool) or not isinstance(salt, (str, bytes, int))):
        raise TypeError(f"{name}.prefix_caching_salt={salt!r} must be None, a str, bytes or "
                        "an int")
    own = DynamicInferenceRequest(request_id=rid, prompt_tokens=prompt, prompt=request.prompt,
                                  prefix_caching_salt=salt)
    own.sampling_params = params  # already a copy: no second deep copy
    return own


def as_list(name: str, values: Any, kind: str, *, one: bool = False) -> List[Any]:
    """``values`` (a sequence, one entry per request) as a list, else ``TypeError`` naming
    ``name``; a str, a mapping or a set is refused (its items are not the entries)."""
    if isinstance(values, (str, bytes, dict, set, frozenset)) or not hasattr(values, "__iter__"):
        one_of = f"a {kind} or " if one else ""
        raise TypeError(f"{name} must be {one_of}a list of {kind} (one per request), got "
                        f"{type(values).__name__}")
    return list(values)


def check_prompts(prompts: Any) -> List[Any]:
    """``prompts`` as a list of prompts; a flat list of ints or a single string is refused."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts is a {type(prompts).__name__}: give a list of prompts, each a "
                        "list of token ids")
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts as a tensor must be 2-D [prompts, tokens], got shape "
                             f"{tuple(prompts.shape)}")
        return list(prompts)
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}") \
            from None
    if prompts and all(_is_int(p) or isinstance(p, numbers.Real) for p in prompts):
        raise TypeError(f"prompts is a flat list of {len(prompts)} numbers; give a list of "
                        "prompts (each a list of token ids), e.g. [prompt] for one prompt")
    return prompts
