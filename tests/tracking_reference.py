"""Per-layer variance tracking written out from compressed_opt.variance_tracking's doc, one layer
at a time in plain Python, for the optimizers' reference runs."""


class TrackingReference:
    """The warmup EMAs of the averaged gradient's mean square and of the ranks' local ones, the
    calibration and the reference at the freeze, then ``rho`` and the factor from the ranks' local
    mean squares."""

    def __init__(self, layers):
        self.n = len(layers)
        self.ema, self.local, self.updates = [0.0] * self.n, [0.0] * self.n, 0

    def warmup(self, averaged, local=None):
        """A warmup (or refresh) step's averaged gradient, per layer; ``local[r][layer]``: rank
        ``r``'s gradient of that layer at that step (``None``: not seen, the reference is then
        made from the first compression steps)."""
        self.ema = [0.9 * e + 0.1 * float((g.double() ** 2).sum()) for e, g in zip(self.ema, averaged)]
        if local is None:
            self.local = [float("nan")] * self.n
        else:
            sums = [sum(float((g[layer].double() ** 2).sum()) for g in local) / len(local) for layer in range(self.n)]
            self.local = [0.9 * e + 0.1 * s for e, s in zip(self.local, sums)]
        self.updates += 1

    def freeze(self, v_raw):
        """The raw (not bias-corrected) variance at the freeze, per layer."""
        debias = 1 - 0.9**self.updates
        a = [e / v.numel() / debias for e, v in zip(self.ema, v_raw)]
        self.cal = [float(v.double().mean()) / x if x > 0 else 0.0 for v, x in zip(v_raw, a)]
        # (the loops of these references leave the average alone: as backward made it, it is the EMA's)
        kappa = [loc / e if e > 0 else float("nan") for loc, e in zip(self.local, self.ema)]
        self.fixed = [k == k and k > 0 and c > 0 for k, c in zip(kappa, self.cal)]  # (k == k: not NaN)
        self.rho = [1.0] * self.n
        self.ref = [k * float(v.double().mean()) if f else 0.0 for k, v, f in zip(kappa, v_raw, self.fixed)]

    def factors(self, local, since, now, then, beta2, debiased=True):
        """``local[r][layer]``: rank ``r``'s gradient of that layer; ``since``: compression steps so
        far (this one included); ``now``, ``then``: updates of Adam's v now and at the freeze."""
        out = []
        for layer in range(self.n):
            w = sum(float((g[layer].double() ** 2).mean()) for g in local) / len(local)
            if since <= 10 and not self.fixed[layer]:
                self.ref[layer] += (w * self.cal[layer] - self.ref[layer]) / since
            self.rho[layer] = (beta2 * self.rho[layer]
                               + (1 - beta2) * (w / self.ref[layer] if self.ref[layer] > 0 else 1.0))
            c = (1 - beta2**then) / (1 - beta2**now) if debiased else 1.0
            out.append(min(4.0, max(0.25, (self.rho[layer] * c) ** -0.5)))
        return out
