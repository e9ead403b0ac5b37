"""Parity with slime's published formulas: every estimator and loss of slimectl.algorithms
against a transcription of slime's definitions (``slime/utils/ppo_utils.py``, ``loss.py``,
``cp_utils.get_sum_of_sample_mean``, ``distributed_masked_whiten``, ``rollout._post_process_rewards``)
written here on slime's own layout: per-sample lists of 1-D response tensors, concatenated, float32.

``python -m tests.unit.test_slime_formulas`` prints the table of max abs differences (docs/algorithms.md).
Differences are float32 rounding; whitening is compared on loss tokens only (slime leaves its
affine image on masked positions, slimectl writes 0 there; neither reaches the loss).
"""

from __future__ import annotations

import math

import torch

from slimectl.algorithms.advantages import compute_advantages, whiten_advantages
from slimectl.algorithms.kl import compute_approx_kl, kl_loss
from slimectl.algorithms.objective import ObjectiveBatch, compute_objective
from slimectl.contract.config_schema import AlgorithmSection
from slimectl.algorithms.policy_loss import cispo_policy_loss, gspo_policy_loss, opsm_mask, ppo_policy_loss
from slimectl.algorithms.reduce import sample_mean, token_mean
from slimectl.algorithms.rewards import normalize_group_rewards
from slimectl.algorithms.tis import compute_tis_weights

F = torch.float32
TOL = 2e-5


# ----------------------------------------------------------------------------- slime, transcribed


def s_kl(lp, base, kind, ratio=None):
    lr = lp.float() - base.float()
    kl = {"k1": lambda: lr, "k2": lambda: lr**2 / 2.0}.get(kind, lambda: (-lr).exp() - 1 + lr)()
    if ratio is not None:
        kl = ratio * kl
    return kl.clamp(-10, 10) if kind == "low_var_kl" else kl


def s_sum_of_sample_mean(masks, per_token=False):
    lengths = [len(m) for m in masks]

    def f(x):
        parts = x.split(lengths)
        if per_token:
            return sum((p * m).sum() for p, m in zip(parts, masks))
        return sum((p * m).sum() / torch.clamp_min(m.sum(), 1) for p, m in zip(parts, masks))

    return f


def s_reduce(masks, per_token=False):
    """slime's reducer plus Megatron's rescale: / samples, or / sum(clamp_min(n_i, 1)) tokens."""
    f = s_sum_of_sample_mean(masks, per_token)
    denom = sum(torch.clamp_min(m.sum(), 1) for m in masks) if per_token else len(masks)
    return lambda x: f(x) / denom


def s_whiten(values, mask, eps=1e-8):
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = ((values**2) * mask).sum() / n - mean**2
    if n >= 2:
        var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def s_post_process_rewards(raw, n, est, std=True):
    r = torch.tensor(raw, dtype=F).reshape(-1, n)
    r = r - r.mean(-1, keepdim=True)
    if est in ("grpo", "gspo", "cispo") and std and n > 1:
        r = r / (r.std(-1, keepdim=True) + 1e-6)
    return r.flatten()


def s_rpp_returns(rewards, kl, masks, kl_coef, gamma):
    out = []
    for r, k, m in zip(rewards, kl, masks):
        tr = -kl_coef * (k * m)
        tr[m.nonzero(as_tuple=True)[0][-1]] += r
        g, run = torch.zeros_like(tr), torch.tensor(0.0)
        for t in range(len(tr) - 1, -1, -1):
            run = tr[t] + gamma * run
            g[t] = run
        out.append(g)
    return out


def s_policy_loss(ppo_kl, adv, eps, eps_high, eps_c=None):
    ratio = (-ppo_kl).exp()
    pg1 = -ratio * adv
    pg2 = -ratio.clamp(1 - eps, 1 + eps_high) * adv
    pg = torch.maximum(pg1, pg2)
    clipfrac = (pg2 > pg1).float()
    if eps_c is not None:
        pg = torch.where(adv < 0, torch.minimum(-eps_c * adv, pg), pg)
    return pg, clipfrac


def s_cispo(ppo_kl, lp, adv, eps, eps_high):
    ratio = (-ppo_kl).exp()
    tr = ratio.clamp(1 - eps, 1 + eps_high)
    return -tr.detach() * adv * lp, (tr != ratio).float()


def s_gspo_kl(lp_list, old_list, masks):
    return torch.cat([(((o - l) * m).sum() / torch.clamp_min(m.sum(), 1)).expand_as(l)
                      for l, o, m in zip(lp_list, old_list, masks)])


def s_opsm(lp_list, old_list, adv_list, masks, delta):
    keep = []
    for l, o, a, m in zip(lp_list, old_list, adv_list, masks):
        seq_kl = ((o - l) * m).sum() / torch.clamp_min(m.sum(), 1)
        keep.append(1 - ((a < 0) & (seq_kl > delta)).float())
    return torch.cat(keep)


def s_tis(train, rollout, low, high, icepop=False):
    r = torch.exp(train - rollout)
    if icepop:
        return torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))
    return r.clamp(low, high)


# ----------------------------------------------------------------------------- data


def make(seed=0, B=6, T=9, n=3):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, T + 1, (B,), generator=g)]
    mask = torch.zeros(B, T, dtype=F)
    for i, L in enumerate(lengths):
        row = (torch.rand(L, generator=g) > 0.25).to(F)
        row[0] = 1.0
        mask[i, :L] = row

    def tok(scale=1.0, shift=-1.0):
        x = torch.rand(B, T, generator=g, dtype=F) * -scale + shift
        return x * (torch.arange(T) < torch.tensor(lengths).unsqueeze(1))  # 0 past each response

    d = dict(mask=mask, lengths=lengths, lp=tok(1.0), old=tok(1.0), ref=tok(1.0), roll=tok(1.0),
             adv=torch.randn(B, T, generator=g, dtype=F), ent=torch.rand(B, T, generator=g, dtype=F) * 3,
             raw=[float(x) for x in torch.randint(0, 2, (B,), generator=g)], n=n)
    d["old"] = d["lp"] + 0.3 * torch.randn(B, T, generator=g, dtype=F) * mask  # ratios around 1
    d["roll"] = d["old"] + 0.5 * torch.randn(B, T, generator=g, dtype=F) * mask
    return d


def lists(x, lengths):
    return [x[i, :L].clone() for i, L in enumerate(lengths)]


def cat(x, lengths):
    return torch.cat(lists(x, lengths))


def diff_on_mask(ours, theirs_cat, d):
    return (cat(ours, d["lengths"]) - theirs_cat).abs()[cat(d["mask"], d["lengths"]).bool()].max().item()


# ----------------------------------------------------------------------------- the comparisons


def comparisons(seed=0) -> dict[str, float]:
    d = make(seed)
    L, mask = d["lengths"], d["mask"]
    masks = lists(mask, L)
    red, red_tok = s_reduce(masks), s_reduce(masks, per_token=True)
    out: dict[str, float] = {}

    # reward post-processing and estimators
    for est, mode in (("grpo", "group_mean_std"), ("reinforce_plus_plus_baseline", "group_mean")):
        ours = normalize_group_rewards(d["raw"], d["n"], mode)
        out[f"reward norm {mode}"] = (ours - s_post_process_rewards(d["raw"], d["n"], est)).abs().max().item()
    r = s_post_process_rewards(d["raw"], d["n"], "grpo")
    ours = compute_advantages("grpo", r, mask).advantages
    out["grpo / gspo / cispo advantages"] = diff_on_mask(ours, torch.cat([torch.ones(n) * r[i] for i, n in enumerate(L)]), d)
    rw = s_post_process_rewards(d["raw"], d["n"], "grpo", std=False) * 0 + torch.tensor(d["raw"])  # rpp: raw
    kl_l = [s_kl(a, b, "k1") for a, b in zip(lists(d["old"], L), lists(d["ref"], L))]
    g = torch.cat(s_rpp_returns(rw, kl_l, masks, 0.1, 0.95))
    ours = compute_advantages("reinforce_plus_plus", rw, mask, log_probs=d["old"], ref_log_probs=d["ref"], kl_coef=0.1,
                              kl_type="k1", gamma=0.95, response_mask=mask)
    out["reinforce_plus_plus returns"] = diff_on_mask(ours.returns, g, d)
    out["reinforce_plus_plus advantages (whitened)"] = diff_on_mask(ours.advantages, s_whiten(g, torch.cat(masks)), d)
    rb = s_post_process_rewards(d["raw"], d["n"], "reinforce_plus_plus_baseline")
    kl3 = [s_kl(a, b, "k3") for a, b in zip(lists(d["old"], L), lists(d["ref"], L))]
    a = torch.cat([torch.ones_like(k) * rb[i] - 0.1 * k for i, k in enumerate(kl3)])
    ours = compute_advantages("reinforce_plus_plus_baseline", rb, mask, log_probs=d["old"], ref_log_probs=d["ref"],
                              kl_coef=0.1, kl_type="k3", response_mask=mask)
    out["reinforce_plus_plus_baseline advantages (whitened)"] = diff_on_mask(ours.advantages,
                                                                             s_whiten(a, torch.cat(masks)), d)
    out["whitening (normalize_advantages)"] = diff_on_mask(whiten_advantages(d["adv"] * mask, mask),
                                                            s_whiten(cat(d["adv"] * mask, L), torch.cat(masks)), d)

    # KL estimators and the KL loss
    lp_c, old_c, ref_c = cat(d["lp"], L), cat(d["old"], L), cat(d["ref"], L)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        out[f"KL {kind}"] = diff_on_mask(compute_approx_kl(d["lp"], d["ref"], kind, mask=mask), s_kl(lp_c, ref_c, kind), d)
    ratio = torch.exp(lp_c - old_c)
    ours = kl_loss(d["lp"], d["ref"], mask, "low_var_kl", old_log_probs=d["old"])
    out["KL loss low_var_kl, use_unbiased_kl"] = abs(ours.item() - red(s_kl(lp_c, ref_c, "low_var_kl", ratio)).item())

    # policy losses, reduced both ways
    adv_c = cat(d["adv"], L)
    for name, kw in (("PPO clip (0.2 / 0.28)", {}), ("PPO dual clip (c = 3)", {"eps_clip_c": 3.0})):
        o = ppo_policy_loss(d["lp"], d["old"], d["adv"], mask, eps_clip=0.2, eps_clip_high=0.28, **kw)
        pg, cf = s_policy_loss(old_c - lp_c, adv_c, 0.2, 0.28, kw.get("eps_clip_c"))
        out[f"{name}, sample mean"] = abs(o.loss("sample_mean").item() - red(pg).item())
        out[f"{name}, per token"] = abs(o.loss("token_mean").item() - red_tok(pg).item())
        out[f"{name} clipfrac"] = abs(sample_mean(o.clipfrac, mask).item() - red(cf).item())
    o = gspo_policy_loss(d["lp"], d["old"], d["adv"], mask, eps_clip=3e-4, eps_clip_high=4e-4)
    pg, _ = s_policy_loss(s_gspo_kl(lists(d["lp"], L), lists(d["old"], L), masks), adv_c, 3e-4, 4e-4)
    out["GSPO (3e-4 / 4e-4)"] = abs(o.loss().item() - red(pg).item())
    o = cispo_policy_loss(d["lp"], d["old"], d["adv"], mask, eps_clip=1.0, eps_clip_high=4.0)
    pg, _ = s_cispo(old_c - lp_c, lp_c, adv_c, 1.0, 4.0)
    out["CISPO (1.0 / 4.0)"] = abs(o.loss().item() - red(pg).item())
    keep = opsm_mask(d["lp"], d["old"], d["adv"], mask, 1e-4).keep
    out["OPSM mask (delta 1e-4)"] = diff_on_mask(keep, s_opsm(lists(d["lp"], L), lists(d["old"], L),
                                                               lists(d["adv"], L), masks, 1e-4), d)
    for mode, ice in (("truncate", False), ("mask", True)):
        w = compute_tis_weights(d["old"], d["roll"], mask, tis_clip=2.0, tis_clip_low=0.5, mode=mode).weights
        out[f"TIS weights, {mode}" + (" (IcePop)" if ice else "")] = diff_on_mask(
            w, s_tis(old_c, cat(d["roll"], L), 0.5, 2.0, ice), d)
    out["per-token mean, a fully masked sample"] = abs(
        token_mean(torch.cat([d["adv"], torch.ones(1, mask.shape[1])]), torch.cat([mask, torch.zeros(1, mask.shape[1])])).item()
        - s_reduce(masks + [torch.zeros(3)], per_token=True)(torch.cat([adv_c, torch.ones(3)])).item())

    # the whole objective: PPO + OPSM + TIS + entropy + unbiased KL loss, both reductions
    ent_c = cat(d["ent"], L)
    for per_token in (False, True):
        cfg = AlgorithmSection(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, entropy_coef=0.01, use_kl_loss=True,
                               kl_loss_coef=0.05, kl_loss_type="low_var_kl", use_unbiased_kl=True, use_tis=True,
                               use_opsm=True, calculate_per_token_loss=per_token)
        loss, _ = compute_objective(cfg, ObjectiveBatch(
            log_probs=d["lp"], mask=mask, entropy=d["ent"], old_log_probs=d["old"], advantages=d["adv"],
            ref_log_probs=d["ref"], trainer_old_log_probs=d["old"], rollout_log_probs=d["roll"]))
        rr = red_tok if per_token else red
        pg, _ = s_policy_loss(old_c - lp_c, adv_c, 0.2, 0.28, 3.0)
        pg = pg * s_opsm(lists(d["lp"], L), lists(d["old"], L), lists(d["adv"], L), masks, 1e-4)
        pg = pg * s_tis(old_c, cat(d["roll"], L), 0.0, 2.0)
        ref_loss = rr(pg) - 0.01 * rr(ent_c) + 0.05 * rr(s_kl(lp_c, ref_c, "low_var_kl", ratio))
        out["full objective, " + ("per token" if per_token else "sample mean")] = abs(loss.item() - ref_loss.item())
    return out


def table(seeds=(0, 1, 2)) -> dict[str, float]:
    worst: dict[str, float] = {}
    for s in seeds:
        for k, v in comparisons(s).items():
            worst[k] = max(worst.get(k, 0.0), v)
    return worst


def test_every_estimator_and_loss_matches_slimes_formula():
    worst = table()
    assert len(worst) >= 25
    bad = {k: v for k, v in worst.items() if not (v <= TOL and math.isfinite(v))}
    assert not bad, bad


if __name__ == "__main__":
    print("| estimator / loss | max abs difference (3 seeds, float32) |\n|---|---|")
    for k, v in table().items():
        print(f"| {k} | {v:.1e} |")
