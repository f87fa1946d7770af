"""An independent, naive NumPy (float64) implementation of docs/method.md, for the equivalence tests.

Written straight from the equations: rank-one contributions are materialised as ``d_in x d_out``
matrices, ranks and modules are looped over in Python. Only the Flax layout
``A (..., d_in, r)``, ``B (..., r, d_out)`` is handled; leading axes are looped over too.
"""

import itertools
import math

import numpy as np


def velocity(a, b, ga, gb):
  """Per-rank velocity of one 2-D module by materialising each rank-one change."""
  r = a.shape[1]
  out = np.zeros(r)
  for k in range(r):
    change = np.outer(ga[:, k], b[k, :]) + np.outer(a[:, k], gb[k, :])
    out[k] = np.sqrt(np.sum(change**2))
  return out


def snr(dir_a, dir_b):
  r = dir_a.shape[1]
  return np.array(
      [math.sqrt(np.sum(dir_a[:, k] ** 2) + np.sum(dir_b[k, :] ** 2)) for k in range(r)]
  )


def multipliers(nu_bar, snr_k, alpha, beta, kappa):
  r = len(nu_bar)
  if np.mean(nu_bar) <= 0 or np.mean(snr_k) <= 0:
    return np.ones(r)
  nu_t = nu_bar / np.mean(nu_bar)
  snr_t = snr_k / np.mean(snr_k)
  s = np.empty(r)
  for k in range(r):
    log_s = alpha * math.log(1.0 / nu_t[k]) + beta * math.log(snr_t[k])
    log_s = min(max(log_s, -math.log(kappa)), math.log(kappa))
    s[k] = math.exp(log_s)
  return s / np.mean(s)


class NumpyAnLR:
  """AdamW + AnLR over a dict of named leaves; ``modules`` maps a name to its (a_key, b_key)."""

  def __init__(self, params, modules, *, lr, b1, b2, eps, wd, alpha, beta, kappa, rho, warmup):
    self.modules = modules
    self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
    self.alpha, self.beta, self.kappa, self.rho, self.warmup = alpha, beta, kappa, rho, warmup
    self.m = {k: np.zeros_like(v) for k, v in params.items()}
    self.v = {k: np.zeros_like(v) for k, v in params.items()}
    self.nu_bar = {
        n: np.zeros(params[a].shape[:-2] + (params[a].shape[-1],)) for n, (a, _) in modules.items()
    }
    self.t = 0
    self.last_s = {}

  def step(self, params, grads):
    """Returns the new parameters."""
    self.t += 1
    t = self.t
    eta = self.lr(t - 1)  # optax evaluates the schedule at the pre-increment count
    delta, direction = {}, {}
    for key, p in params.items():
      g = grads[key]
      self.m[key] = self.b1 * self.m[key] + (1 - self.b1) * g
      self.v[key] = self.b2 * self.v[key] + (1 - self.b2) * g * g
      m_hat = self.m[key] / (1 - self.b1**t)
      v_hat = self.v[key] / (1 - self.b2**t)
      direction[key] = m_hat / (np.sqrt(v_hat) + self.eps)
      delta[key] = -eta * (direction[key] + self.wd * p)
    for name, (ka, kb) in self.modules.items():
      a, b = params[ka], params[kb]
      s_all = np.ones(self.nu_bar[name].shape)
      for idx in itertools.product(*[range(n) for n in a.shape[:-2]]):
        nu = velocity(a[idx], b[idx], grads[ka][idx], grads[kb][idx])
        self.nu_bar[name][idx] = self.rho * self.nu_bar[name][idx] + (1 - self.rho) * nu
        sn = snr(direction[ka][idx], direction[kb][idx])
        if t > self.warmup:
          s_all[idx] = multipliers(self.nu_bar[name][idx], sn, self.alpha, self.beta, self.kappa)
      self.last_s[name] = s_all
      delta[ka] = delta[ka] * s_all[..., None, :]
      delta[kb] = delta[kb] * s_all[..., :, None]
    return {k: params[k] + delta[k] for k in params}
