"""The demo's ``--speculative ngram|draft`` (speculative decoding, ``engine/speculative_step.py``):
the engine options it adds, and its summary line."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional


def check_speculative(args) -> Optional[str]:
    """How ``--speculative`` combines with the other flags; None when it does."""
    if args.speculative == "off":
        return None
    k = args.speculative_tokens
    if k >= args.block_size:
        return (f"--speculative-tokens {k} must be below --block-size {args.block_size} (a "
                "step's 1 + k tokens fit in two blocks)")
    return None


def speculative_options(args, hf_model: Any, make_model: Callable[..., Any]) -> Dict[str, Any]:
    """``Engine.from_transformers`` options of ``--speculative``: the n-gram drafter, or a draft
    model of the target's family, a truncated copy of it (its first ``max(1, layers // 4)``
    layers, the same embedding and head: its guesses relate to the target's)."""
    if args.speculative == "off":
        return {}
    drafter: Any = "ngram"
    if args.speculative == "draft":
        parameter = next(hf_model.parameters())
        drafter = make_model(max(1, args.layers // 4)).to(device=parameter.device,
                                                          dtype=parameter.dtype)
        drafter.load_state_dict(hf_model.state_dict(), strict=False)
    return dict(num_speculative_tokens=args.speculative_tokens, drafter=drafter)


def speculative_summary(args, stats) -> Optional[str]:
    """The summary's line of the speculative counters (None without ``--speculative``)."""
    spec = stats.speculative
    if not spec:
        return None
    return (f"speculative       {args.speculative} drafter, k={spec['num_speculative_tokens']}: "
            f"{spec['accepted_tokens']} of {spec['draft_tokens']} drafts accepted "
            f"({100 * spec['acceptance_rate']:.0f}%), "
            f"{spec['tokens_per_forward']:.2f} tokens per decode request and step")
