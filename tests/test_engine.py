"""The gradient-sync engine as another optimizer drives it (compressed_opt.engine.GradientSync).

The engine exchanges whatever flat buffer it is handed, with the paths, error feedback and byte
counting the optimizers use. Here a second client, written as a user would write one (a local-SGD
optimizer that averages its parameters' change every ``k`` steps through the 1-bit exchange),
drives an engine of its own: no gradient hooks, no bucket, no algorithm of ours.
"""
from __future__ import annotations

import torch

from distributed import spawn_ranks


class LocalSGD(torch.optim.Optimizer):
    """``k`` local SGD steps, then the pseudo-gradient ``anchor - params`` averaged over the ranks
    by the engine's 1-bit exchange with error feedback, and the anchor moved by the average: every
    rank's parameters equal after each sync."""

    def __init__(self, params, lr: float, k: int):
        from compressed_opt.comm import DEFAULT_BLOCK, resolve_backend
        from compressed_opt.engine import GradientSync
        from compressed_opt.exchange import ErrorFeedback
        from compressed_opt.local_shards import LocalShards

        super().__init__(params, dict(lr=lr))
        self.k, self.steps = k, 0
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.anchor = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.delta = torch.empty_like(self.anchor)
        self.feedback = ErrorFeedback()
        self.engine = GradientSync("LocalSGD", self.param_groups, resolve_backend(None), None, LocalShards("LocalSGD"),
                                   bucket_cap_bytes=1 << 20, overlap=False, accumulation_steps=1, hierarchy="flat",
                                   path="1bit", scale_block=DEFAULT_BLOCK)

    @torch.no_grad()
    def step(self):
        from compressed_opt.exchange import Request

        for g in self.param_groups:
            torch._foreach_add_(g["params"], [p.grad for p in g["params"]], alpha=-g["lr"])
        self.steps += 1
        if self.steps % self.k:
            return
        torch.sub(self.anchor, torch.cat([p.reshape(-1) for p in self.params]), out=self.delta)
        self.engine.run([Request(self.delta, self.feedback)])  # the average, in place
        self.anchor.sub_(self.delta)
        views = self.anchor.split([p.numel() for p in self.params])
        torch._foreach_copy_(self.params, [v.view_as(p) for v, p in zip(views, self.params)])


def _local_sgd(rank, world, k, steps):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = LocalSGD(model.parameters(), lr=0.05, k=k)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x[:, :1]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    sent = opt.engine.traffic.end_step("compression")
    opt.engine.close()
    return dict(equal=all(torch.equal(gathered[0], t) for t in gathered), losses=losses, sent=sent,
                errors=[float(opt.feedback.worker_error.abs().sum()), float(opt.feedback.server_error.abs().sum())],
                numel=flat.numel())


def test_another_optimizer_drives_the_engine_with_error_feedback():
    """Every 4 steps the pseudo-gradient goes through the engine's 1-bit exchange: the ranks end
    with equal parameters, the error-feedback buffers hold what compression left out (nonzero), the
    engine counts the bytes (about 1 bit per element per sync, far below fp32's 4 bytes), and the
    loss falls."""
    k, steps = 4, 40
    outcomes = spawn_ranks(_local_sgd, 2, k, steps, timeout=100)
    assert [status for status, _ in outcomes] == ["ok", "ok"], outcomes
    for _, r in outcomes:
        assert r["equal"]
        assert all(e > 0 for e in r["errors"])
        syncs, fp32 = steps // k, r["numel"] * 4
        assert 0 < r["sent"] < syncs * fp32 / 8  # (a 1-bit exchange: ~1/32 of fp32 per sync, plus scales)
        first, last = sum(r["losses"][:k]) / k, sum(r["losses"][-k:]) / k
        assert last < 0.7 * first
