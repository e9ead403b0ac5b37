"""Convert tiny VLMs to Megatron at this launch's TP, load them back and compare their logits on an image+text prompt
with HF's; check ``train.freeze: [vision]`` on the loaded model. One RESULT JSON line per model (TP rank 0).

    [torchrun --nproc_per_node TP] vlm_mcore_check.py TP INPUTS HF_DIR OUT [HF_DIR OUT ...]

INPUTS: a torch file written by the test (tests/integration/test_vlm_megatron.py), ``{hf_dir: {input_ids,
position_ids, pixel_values, image_grid_thw, logits}}``: HF's own fp32 logits and M-RoPE positions for the prompt,
computed in the test's process (the ranks never load the HF model).
"""

import json
import sys

import torch


def main() -> None:
    tp, inputs, pairs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    from slimectl.stages.convert import convert_hf_to_megatron

    refs = torch.load(inputs, weights_only=True)
    for hf, out in zip(pairs[::2], pairs[1::2]):
        convert_hf_to_megatron(hf, out, tp=tp, pp=1, progress="off")
        check(tp, out, refs[hf])


def check(tp: int, ckpt: str, ref: dict) -> None:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from slimectl.backends.megatron.checkpoint import arch_from_meta, load_megatron_checkpoint, read_checkpoint_meta
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.backends.megatron.provider import build_gpt_model
    from slimectl.backends.megatron.vlm import VisionInputs, apply_freeze, vlm_forward

    info = init_parallel(tp=tp, pp=1)
    try:
        meta, it_dir, _ = read_checkpoint_meta(ckpt)
        arch = arch_from_meta(meta)
        model = build_gpt_model(arch, meta["padded_vocab_size"], tp=tp, pp=1, init=False).eval()
        load_megatron_checkpoint(model, it_dir)
        vision = VisionInputs(ref["pixel_values"], ref["image_grid_thw"])
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(
                vlm_forward(model, ref["input_ids"], ref["position_ids"], vision))[..., :arch.vocab_size]
            text_pos = torch.arange(ref["input_ids"].shape[1]).expand(3, 1, -1)
            flat = gather_from_tensor_model_parallel_region(
                vlm_forward(model, ref["input_ids"], text_pos, vision))[..., :arch.vocab_size]
        diff = (logits - ref["logits"]).abs().max().item()
        result = {"vlm": arch.vlm, "tp": tp, "max_abs_diff": diff, "scale": ref["logits"].abs().max().item(),
                  "text_positions_diff": (flat - ref["logits"]).abs().max().item(), **freeze_check(model, vision,
                                                                                                  ref, apply_freeze)}
        if info.tp_rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        shutdown_parallel()


def _grads(model, vision, ref) -> dict:
    """The gradients of a loss over the logits (every parameter that takes one), then cleared. The row as one packed
    sequence, as the training forward runs it (``attention.packed_segments``)."""
    from slimectl.backends.megatron.attention import packed_segments

    model.zero_grad(set_to_none=True)
    with packed_segments([ref["input_ids"].shape[1]]):
        out = model(ref["input_ids"], ref["position_ids"], None, vision=vision)
        out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def recompute_check(model, vision, ref) -> dict:
    """Gradients reach the vision tower; ``train.recompute`` full gives the same gradients (Qwen2.5-VL) or is refused
    in one line (Qwen3-VL's deepstack), and auto then recomputes nothing."""
    from slimectl.backends.megatron.recompute import set_recompute
    from slimectl.contract.config_schema import TrainSection

    model.train()
    plain = _grads(model, vision, ref)
    out = {"vision_grads_unfrozen": sum(n.startswith("vision.") and bool(g.abs().sum() > 0) for n, g in plain.items())}
    try:
        set_recompute(model, TrainSection(recompute="full"))
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        set_recompute(model, TrainSection(recompute="auto"))
        return {**out, "recompute_refused": f"{type(exc).__name__}: {exc}",
                "auto_recompute": str(model.config.recompute_granularity)}
    again = _grads(model, vision, ref)
    model.config.recompute_granularity = None
    return {**out, "recompute_grad_diff": max((again[n] - g).abs().max().item() for n, g in plain.items()),
            "recompute_grads": len(again), "plain_grads": len(plain)}


def freeze_check(model, vision, ref, apply_freeze) -> dict:
    """``train.freeze: [vision]``: a backward leaves the tower's parameters without gradients, the language
    model's with them, and the optimizer holds only the language model's; an unknown name is refused."""
    out = recompute_check(model, vision, ref)
    apply_freeze(model, ["language"])  # the other way round: only the tower trains
    only_vision = _grads(model, vision, ref)
    out.update(language_frozen_vision_grads=sum(n.startswith("vision.") for n in only_vision),
               language_frozen_language_grads=sum(not n.startswith("vision.") for n in only_vision))
    model.requires_grad_(True)
    frozen = apply_freeze(model, ["vision"])
    model.train()
    logits = model(ref["input_ids"], ref["position_ids"], None, vision=vision)
    logits.float().pow(2).mean().backward()
    vis = [p for n, p in model.named_parameters() if n.startswith("vision.")]
    lang = [p for n, p in model.named_parameters() if not n.startswith("vision.")]
    try:
        apply_freeze(model, ["visoin"])
        refused = ""
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        refused = f"{type(exc).__name__}: {exc}"
    from slimectl.backends.megatron.model import MegatronModel
    from slimectl.contract.config_schema import TrainSection

    out.update({"frozen": frozen, "vision_params": sum(p.numel() for p in vis),
                "vision_grads": sum(p.grad is not None for p in vis), "vision_trainable": sum(p.requires_grad for p in vis),
                "language_grads": sum(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in lang),
                "language_params": len(lang), "refused": refused})
    trained = MegatronModel(model, model.config, TrainSection(freeze=["vision"]), total_steps=1)
    in_optimizer = {id(p) for g in trained.optimizer.param_groups for p in g["params"]}
    out.update(qk_norm_grads(trained, vision, ref))  # (the optimizer's zero_grad clears the .grad read above)
    return {**out, "vision_in_optimizer": sum(id(p) in in_optimizer for p in vis),
            "language_in_optimizer": sum(id(p) in in_optimizer for p in lang)}


def qk_norm_grads(trained, vision, ref) -> dict:
    """Qwen3's q/k norm under TP: after ``finish_grads`` every TP rank holds the whole gradient of layer 0's
    ``q_layernorm`` (each rank's heads' parts summed), the same on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slimectl.backends.megatron.attention import packed_segments

    params = dict(trained.module.named_parameters())
    name = "decoder.layers.0.self_attention.q_layernorm.weight"
    if name not in params:
        return {}
    trained.zero_grad()
    with packed_segments([ref["input_ids"].shape[1]]):
        trained.ddp(ref["input_ids"], ref["position_ids"], None, vision=vision).float().pow(2).sum().backward()
    trained.finish_grads()
    grad = params[name].main_grad.detach().clone()
    ranks = [torch.zeros_like(grad) for _ in range(trained.tp)]
    dist.all_gather(ranks, grad, group=ps.get_tensor_model_parallel_group())
    return {"q_norm_grad": grad.tolist(), "q_norm_grad_ranks_agree": all(torch.equal(r, grad) for r in ranks)}


if __name__ == "__main__":
    main()
