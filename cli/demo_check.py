"""The demo's verdicts: every output against ``transformers``' greedy ``generate`` for that
prompt alone, and, under tensor parallelism, every rank against rank 0."""

from __future__ import annotations

# bf16/fp16 runs may diverge from transformers at a near-tie: accepted when the top two
# reference logits lie within this much (absolute, plus relative to the top logit).
HALF_TIE_ATOL, HALF_TIE_RTOL = 2e-2, 2e-2
# An FP8 KV cache moves logits by a few percent (bench/fp8_kv.py): a divergence is accepted
# where the top two reference logits lie within this much.
FP8_TIE_ATOL, FP8_TIE_RTOL = 0.1, 0.1


def ranks_agree(results, rank: int, world: int) -> int:
    """0 when every rank generated rank 0's tokens; else 1 on every rank (rank 0 says which)."""
    import torch.distributed as dist

    mine = [r.generated_tokens for r in results]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    differ = [r for r in range(1, world) if gathered[r] != gathered[0]]
    if differ and rank == 0:
        print(f"MISMATCH: ranks {differ} generated other tokens than rank 0")
    return 1 if differ else 0


def against_transformers(hf_model, request, result, eos, device, *, half: bool,
                         fp8: bool = False):
    """``"exact"``, ``"near-tie"`` (fp16/bf16 or an FP8 KV cache diverging where the
    reference's top two logits nearly tie), or the index of the first token that differs."""
    import torch

    prompt = request.prompt_tokens.unsqueeze(0).to(device)
    reference = hf_model.generate(
        prompt, max_new_tokens=request.sampling_params.num_tokens_to_generate,
        do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    reference = reference[0, prompt.shape[1]:].tolist()
    ours = result.generated_tokens
    if ours == reference:
        return "exact"
    diverge = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b),
                   min(len(ours), len(reference)))
    if (half or fp8) and diverge < min(len(ours), len(reference)):
        sequence = result.prompt_tokens + ours[:diverge]
        with torch.no_grad():
            logits = hf_model(torch.tensor([sequence], device=device)).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        atol, rtol = (FP8_TIE_ATOL, FP8_TIE_RTOL) if fp8 else (HALF_TIE_ATOL, HALF_TIE_RTOL)
        if top[0] - top[1] <= atol + rtol * top[0].abs():
            return "near-tie"
    return diverge
