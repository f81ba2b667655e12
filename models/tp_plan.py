"""Tensor parallelism for the generic transformers path, from the model's own plan.

A ``transformers`` config declares how its base model splits over tensor-parallel ranks
(``base_model_tp_plan``: module or parameter name patterns, ``layers.*.self_attn.q_proj``, to
a style). ``shard_by_plan(hf_model, tp)`` returns a copy of the model holding this rank's shard,
with the styles Megatron's column- and row-parallel layers are made of:

* ``colwise`` (an ``nn.Linear``): this rank's rows of the weight and bias (its query or KV
  heads, its MLP channels);
* ``rowwise`` (an ``nn.Linear``): this rank's columns; its output is summed over the group
  (one ``all_reduce``) and the bias added once, after the sum;
* ``packed_colwise`` (a ``[experts, 2 * I, hidden]`` parameter, gate and up stacked): this
  rank's part of each half;
* ``rowwise`` on a ``[experts, hidden, I]`` parameter: this rank's part of ``I``;
* ``moe_tp_experts`` (the experts module): its output summed over the group;
* ``replicated_with_grad_allreduce`` (per-head norms): whole on every rank.

Embeddings, norms, the router and the LM head stay whole, so every rank computes the same
logits. Any other style (``colwise_gather_output``, ``embedding_rowwise``, ...) is refused with
``NotImplementedError`` naming it, as is a model without a plan; a size that the ranks do not
divide raises ``ValueError`` naming the parameter. Every check runs before the copy is made.
The copy costs one model's memory per rank, as the dedicated adapters' weight slicing does
(docs/DESIGN.md §10): the tests' and the demo's models are small.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ._common import TensorParallel

STYLES = ("colwise", "rowwise", "packed_colwise", "moe_tp_experts",
          "replicated_with_grad_allreduce")


def _rules(plan: dict) -> List[Tuple[Any, str]]:
    return [(re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$"), style)
            for key, style in plan.items()]


def _style(rules: List[Tuple[Any, str]], name: str) -> Optional[str]:
    return next((style for pattern, style in rules if pattern.match(name)), None)


def plan_actions(hf_model: Any, tp: TensorParallel) -> List[Tuple[str, str]]:
    """``[(name in the base model, style)]`` of every module and parameter the plan shards,
    after checking the plan and every size (``NotImplementedError``/``ValueError``)."""
    name = type(hf_model).__name__
    config = hf_model.config
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise NotImplementedError(f"{name} has no base_model_tp_plan: the generic path shards "
                                  "a model by its own tensor-parallel plan")
    unknown = sorted({f"{key}: {style}" for key, style in plan.items() if style not in STYLES})
    if unknown:
        raise NotImplementedError(f"{name}'s tensor-parallel plan has styles the generic path "
                                  f"does not run: {unknown} (supported {list(STYLES)})")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for field, heads in (("num_attention_heads", config.num_attention_heads),
                         ("num_key_value_heads", kv_heads)):
        tp.part(heads, f"{name} {field}")
    rules = _rules(plan)
    base = hf_model.base_model
    actions = []
    for module_name, module in base.named_modules():
        style = _style(rules, module_name)
        if style in ("colwise", "rowwise"):
            if not isinstance(module, nn.Linear):
                raise NotImplementedError(f"{name}: {module_name} is planned {style!r} but is a "
                                          f"{type(module).__name__}, not an nn.Linear")
            dim = 0 if style == "colwise" else 1
            tp.part(module.weight.shape[dim], f"{module_name}.weight.shape[{dim}]")
            actions.append((module_name, style))
        elif style == "moe_tp_experts":
            actions.append((module_name, style))
    hidden = config.hidden_size
    for param_name, param in base.named_parameters():
        style = _style(rules, param_name)
        if style not in ("packed_colwise", "rowwise"):
            continue
        # [experts, 2 * I, hidden] (gate and up stacked) or [experts, hidden, I].
        shape = tuple(param.shape)
        expected = shape[-1] == hidden if style == "packed_colwise" else shape[-2] == hidden
        if len(shape) != 3 or not expected or (style == "packed_colwise" and shape[1] % 2):
            raise NotImplementedError(f"{name}: {param_name} of shape {list(shape)} is planned "
                                      f"{style!r}; the generic path shards [experts, 2 * I, "
                                      "hidden] gate/up and [experts, hidden, I] down weights")
        channels = shape[1] // 2 if style == "packed_colwise" else shape[2]
        tp.part(channels, f"{param_name} channels")
        actions.append((param_name, style))
    return actions


def _reduce_hook(tp: TensorParallel, bias: Optional[torch.Tensor]) -> Callable:
    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        out = tp.reduce(output)
        return out if bias is None else out + bias

    return hook


def shard_by_plan(hf_model: Any, tp: TensorParallel) -> Any:
    """A copy of ``hf_model`` holding this rank's shard (module docstring); the model itself
    is left as it was."""
    actions = plan_actions(hf_model, tp)
    model = copy.deepcopy(hf_model)
    base = model.base_model
    modules = dict(base.named_modules())
    with torch.no_grad():
        for name, style in actions:
            if style in ("colwise", "rowwise") and name in modules:
                linear = modules[name]
                dim = 0 if style == "colwise" else 1
                linear.weight = nn.Parameter(tp.shard(linear.weight.data, dim, tp.size),
                                             requires_grad=False)
                if style == "colwise" and linear.bias is not None:
                    linear.bias = nn.Parameter(tp.shard(linear.bias.data, 0, tp.size),
                                               requires_grad=False)
                if style == "rowwise":
                    bias = None if linear.bias is None else linear.bias.data
                    linear.bias = None
                    linear.register_forward_hook(_reduce_hook(tp, bias))
                linear.in_features, linear.out_features = (linear.weight.shape[1],
                                                           linear.weight.shape[0])
            elif style == "moe_tp_experts":
                modules[name].register_forward_hook(_reduce_hook(tp, None))
            else:
                owner_name, _, attribute = name.rpartition(".")
                owner = modules[owner_name]
                weight = getattr(owner, attribute).data
                if style == "packed_colwise":
                    gate, up = weight.chunk(2, dim=1)
                    weight = torch.cat((tp.shard(gate, 1, tp.size), tp.shard(up, 1, tp.size)), 1)
                else:
                    weight = tp.shard(weight, 2, tp.size)
                setattr(owner, attribute, nn.Parameter(weight, requires_grad=False))
    return model


__all__ = ["STYLES", "plan_actions", "shard_by_plan"]
