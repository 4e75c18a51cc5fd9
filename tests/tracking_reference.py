"""Per-layer variance tracking written out from compressed_opt.variance_tracking's doc, one layer
at a time in plain Python, for the optimizers' reference runs."""


class TrackingReference:
    """The warmup EMA of the averaged gradient's mean square, the calibration at the freeze, then
    ``rho`` and the factor from the ranks' local mean squares."""

    def __init__(self, layers):
        self.n = len(layers)
        self.ema, self.updates = [0.0] * self.n, 0

    def warmup(self, averaged):
        """A warmup (or refresh) step's averaged gradient, per layer."""
        self.ema = [0.9 * e + 0.1 * float((g.double() ** 2).sum()) for e, g in zip(self.ema, averaged)]
        self.updates += 1

    def freeze(self, v_raw):
        """The raw (not bias-corrected) variance at the freeze, per layer."""
        a = [e / v.numel() / (1 - 0.9**self.updates) for e, v in zip(self.ema, v_raw)]
        self.cal = [float(v.double().mean()) / x if x > 0 else 0.0 for v, x in zip(v_raw, a)]
        self.rho, self.ref = [1.0] * self.n, [0.0] * self.n

    def factors(self, local, since, now, then, beta2, debiased=True):
        """``local[r][layer]``: rank ``r``'s gradient of that layer; ``since``: compression steps so
        far (this one included); ``now``, ``then``: updates of Adam's v now and at the freeze."""
        out = []
        for layer in range(self.n):
            w = sum(float((g[layer].double() ** 2).mean()) for g in local) / len(local)
            if since <= 10:
                self.ref[layer] += (w * self.cal[layer] - self.ref[layer]) / since
            self.rho[layer] = (beta2 * self.rho[layer]
                               + (1 - beta2) * (w / self.ref[layer] if self.ref[layer] > 0 else 1.0))
            c = (1 - beta2**then) / (1 - beta2**now) if debiased else 1.0
            out.append(min(4.0, max(0.25, (self.rho[layer] * c) ** -0.5)))
        return out
