"""Requests and sampling parameters, constructible with Megatron-Core's keyword names."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Set
from dataclasses import asdict, dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .inference_request import compute_block_hashes_batched

MetadataTypes = List[Tuple[str, torch.dtype, bool]]


@dataclass
class SamplingParams:
    """Per-request sampling parameters (Megatron-Core's names and defaults).

    ``seed`` is our extension: a per-request generator seed, so that a request's random draws do
    not depend on the batch it runs in.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    return_segments: bool = False
    num_tokens_to_generate: int = 30
    num_tokens_total: Optional[int] = None
    termination_id: Optional[int] = None
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    stop_words: Optional[List[str]] = None
    seed: Optional[int] = None

    def __post_init__(self):
        gen = self.num_tokens_to_generate
        if gen is not None and (isinstance(gen, bool) or not isinstance(
                gen, (int, np.integer)) and not (isinstance(gen, (float, np.floating))
                                                 and float(gen).is_integer())):
            raise TypeError(f"num_tokens_to_generate={gen!r} must be a whole number of tokens "
                            f"(an int), got {type(gen).__name__}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_n_logprobs < 0:
            raise ValueError(f"top_n_logprobs={self.top_n_logprobs} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in [0, 1]")

    def serialize(self) -> dict:
        return asdict(self)

    @classmethod
    def deserialize(cls, data: dict) -> "SamplingParams":
        return cls(**data)


DEFAULT_METADATA_TYPES: MetadataTypes = [
    ("temperature", torch.float32, False),
    ("top_k", torch.int32, False),
    ("top_p", torch.float32, False),
    ("termination_id", torch.int64, True),
    ("return_log_probs", torch.bool, False),
    ("skip_prompt_log_probs", torch.bool, False),
    ("top_n_logprobs", torch.int32, False),
]


class TokenIdError(TypeError, ValueError):
    """Token ids that are not whole numbers (``[1.7]``, NaN): a wrong value given where ids of
    an integer type belong, so both ``except TypeError`` and ``except ValueError`` catch it."""


def whole_number_ids(values: Any, name: str) -> np.ndarray:
    """``values`` (a sequence, numpy array or CPU tensor) as a 1-D int64 array of token ids.

    Integer values pass; floating values pass only when every one is a whole number (a prompt
    read from a float array: ``[1.0, 2.0]``); fractions, NaN and infinities raise
    ``TokenIdError`` and anything else (bools, strings) ``TypeError``, naming ``name``.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a 1-D sequence of integer token ids: {error}") from None
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer)
                                       or np.issubdtype(array.dtype, np.floating)):
        raise TypeError(f"{name} must hold integer token ids, got {array.dtype} values")
    if np.issubdtype(array.dtype, np.floating):
        whole = np.isfinite(array) & (array == np.round(array))
        if not whole.all():
            bad = array[~whole].reshape(-1)[0]
            raise TokenIdError(f"{name} must hold whole numbers (token ids); {float(bad)!r} is "
                               "not a whole number")
        if array.size and (array.max() >= 2 ** 63 or array.min() < -2 ** 63):
            raise ValueError(f"{name} holds ids outside int64")
    return array.astype(np.int64)


def _as_token_tensor(tokens: Any, name: str) -> torch.Tensor:
    """``tokens`` as a 1-D integer tensor.

    Integer tensors are kept as they are (dtype and device). Floating-point tokens are accepted
    when every value is a whole number (Megatron-Core's tests build prompts with
    ``torch.zeros(n)``) and become int64 on the same device; a float tensor on a GPU costs one
    read-back for that check. Sequences and numpy arrays go through ``whole_number_ids``.
    Fractions, NaN/inf (``TokenIdError``), booleans, complex numbers and strings are refused.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
        tensor = tokens
    else:
        if isinstance(tokens, str):
            raise TypeError(f"{name} must be token ids, not a string: tokenize it first")
        if isinstance(tokens, (Mapping, Set)):  # unordered, or keys taken for tokens
            raise TypeError(f"{name} must be token ids in order (a list or a 1-D tensor), not "
                            f"a {type(tokens).__name__}")
        if not isinstance(tokens, (np.ndarray, Sequence)):
            tokens = list(tokens)
        tensor = torch.from_numpy(whole_number_ids(tokens, name))
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point():
        whole = torch.isfinite(tensor) & (tensor == torch.trunc(tensor))
        if not bool(whole.all()):
            bad = tensor[~whole][0].item()
            raise TokenIdError(f"{name} of dtype {tensor.dtype} must hold whole numbers (token "
                               f"ids); {bad!r} is not a whole number")
        if tensor.numel() and not bool((tensor.abs() < 2.0 ** 63).all()):
            raise ValueError(f"{name} holds values beyond the int64 range: "
                             f"{tensor[tensor.abs() >= 2.0 ** 63][:4].tolist()}")
        tensor = tensor.to(torch.int64)
    return tensor


@dataclass
class DynamicInferenceRequest:
    """One request: a prompt, its sampling parameters and its progress.

    ``remaining_prompt_tokens`` and ``finished_chunk_token_count`` track chunked prefill; the
    caller (the engine), not the context, advances them after each ``add_request``.
    ``prefix_caching_salt`` (None, str, bytes or int): requests share cached prompt blocks only
    with requests of the same salt (prefix caching, docs/SEMANTICS.md §17).
    Megatron-Core 0.19's prefix-caching fields: with ``enable_prefix_caching`` and
    ``block_size_tokens``, ``precomputed_block_hashes`` are 0.19's hashes of the prompt's full
    blocks (``compute_block_hashes_batched``; kept when given); ``num_cached_tokens`` is 0.19's
    count of prompt tokens served from the cache. dynctx's context matches on its own salted
    digests (docs/SEMANTICS.md §16).
    """

    request_id: int
    prompt_tokens: Optional[Any] = None
    sampling_params: Optional[SamplingParams] = None
    prompt: Optional[str] = None
    generated_tokens: List[int] = field(default_factory=list)
    generated_log_probs: Optional[List[float]] = None
    prompt_log_probs: Optional[List[float]] = None
    remaining_prompt_tokens: Optional[torch.Tensor] = None
    finished_chunk_token_count: int = 0
    arrival_time: Optional[float] = None
    status: Optional[str] = None
    events: List[Any] = field(default_factory=list)
    prefix_caching_salt: Optional[Any] = None
    block_size_tokens: Optional[int] = None
    enable_prefix_caching: bool = False
    num_cached_tokens: int = 0
    precomputed_block_hashes: List[int] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.enable_prefix_caching, (bool, np.bool_)):
            raise TypeError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a "
                            "bool")
        self.sampling_params = copy.deepcopy(self.sampling_params) or SamplingParams()
        if self.prompt_tokens is not None:
            self.prompt_tokens = _as_token_tensor(self.prompt_tokens, "prompt_tokens")
            if self.remaining_prompt_tokens is None:
                self.remaining_prompt_tokens = self.prompt_tokens.clone()
        if (self.enable_prefix_caching and self.block_size_tokens is not None
                and self.prompt_tokens is not None and not self.precomputed_block_hashes):
            self.precomputed_block_hashes = compute_block_hashes_batched(
                self.prompt_tokens, self.block_size_tokens)

    @property
    def remaining_prompt_length(self) -> int:
        return 0 if self.remaining_prompt_tokens is None else len(self.remaining_prompt_tokens)

    @property
    def tracked_metadata(self) -> List[Any]:
        """Metadata values in ``get_metadata_types()`` order (``termination_id`` None -> -1)."""
        sp = self.sampling_params
        values = []
        for label, _, _ in self.get_metadata_types():
            value = getattr(sp, label)
            if label == "termination_id" and value is None:
                value = -1
            values.append(value)
        return values

    @staticmethod
    def get_metadata_types() -> MetadataTypes:
        """The per-request metadata the context tracks: ``(label, dtype, on_device)``."""
        return list(DEFAULT_METADATA_TYPES)

    def checkpoint(self) -> "DynamicInferenceRequest":
        """A new request whose prompt is this one's prompt plus its generated tokens.

        Used to re-queue an evicted request for recompute: the remaining budget of generated
        tokens shrinks by what was already generated.
        """
        generated = torch.as_tensor(self.generated_tokens, dtype=self.prompt_tokens.dtype)
        params = copy.deepcopy(self.sampling_params)
        params.num_tokens_to_generate = params.num_tokens_to_generate - len(self.generated_tokens)
        return DynamicInferenceRequest(
            request_id=self.request_id,
            prompt_tokens=torch.cat([self.prompt_tokens.cpu(), generated]),
            sampling_params=params, prefix_caching_salt=self.prefix_caching_salt,
            block_size_tokens=self.block_size_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
        )
