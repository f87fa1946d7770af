r"""LoRA-Pro in NumPy float64, written from the paper's equations in the paper's layout.

Wang et al., *LoRA-Pro: Are Low-Rank Adapters Properly Optimized?* (2024): :math:`W = W_0 + sBA`,
``B (m, r)``, ``A (r, n)``. The Flax layout of this project stores ``a = A^T (n, r)``, ``b = B^T (r, m)``;
:func:`module_step` takes and returns that layout and transposes at the boundary. The Sylvester equation
is solved by a Kronecker-product linear system (independent of the eigenbasis solver under test).
"""

import numpy as np


def inverse(gram, ridge):
  """:math:`(G + \\delta I)^+` (``np.linalg.pinv``)."""
  return np.linalg.pinv(gram + ridge * np.eye(gram.shape[0]), hermitian=True)


def sylvester_kron(p, q, c):
  """:math:`PX + XQ = C` via :math:`(P \\otimes I + I \\otimes Q^\\top)\\,\\mathrm{vec}(X) = \\mathrm{vec}(C)`
  (row-major ``vec``); least squares, so singular systems give the minimum-norm solution."""
  r, k = c.shape
  kron = np.kron(p, np.eye(k)) + np.kron(np.eye(r), q.T)
  return np.linalg.lstsq(kron, c.reshape(-1), rcond=None)[0].reshape(r, k)


def adjusted(A, B, gA, gB, s, ridge, sylvester=True):
  """The paper's closed form: ``(g^A, g^B, X)`` in the paper's layout."""
  m = B.shape[0]
  btb_inv = inverse(B.T @ B, ridge)
  aat_inv = inverse(A @ A.T, ridge)
  g_a = btb_inv @ gA / s**2
  g_b = (np.eye(m) - B @ btb_inv @ B.T) @ gB @ aat_inv / s**2
  if sylvester:
    x = sylvester_kron(B.T @ B, A @ A.T, -btb_inv @ gA @ A.T / s**2)
  else:
    x = np.zeros((A.shape[0], A.shape[0]))
  return g_a + x @ A, g_b - B @ x, x


def init_moments(a, b, mode):
  """Moments of one module slice (Flax ``a (n, r)``, ``b (r, m)``); ``"full"``: paper layout (m, n)."""
  if mode == "full":
    shape = (b.shape[1], a.shape[0])
    return np.zeros(shape), np.zeros(shape)
  return (np.zeros(a.shape), np.zeros(b.shape)), (np.zeros(a.shape), np.zeros(b.shape))


def _adam(mu, nu, g, b1, b2, t):
  mu = b1 * mu + (1 - b1) * g
  nu = b2 * nu + (1 - b2) * g * g
  return mu, nu, mu / (1 - b1**t), nu / (1 - b2**t)


def module_step(a, b, ga, gb, mu, nu, t, *, lr, s, b1, b2, eps, wd, ridge, mode):
  """One LoRA-Pro AdamW step of one module slice; returns ``(a_new, b_new, mu, nu)`` (Flax layout)."""
  A, B, gA, gB = a.T, b.T, ga.T, gb.T
  if mode == "full":  # Algorithm 1: Adam on the equivalent gradient, projected back with X
    p_a, p_b, _ = adjusted(A, B, gA, gB, s, ridge, sylvester=False)
    g_eq = s * B @ p_a + s * p_b @ A
    mu, nu, mu_hat, nu_hat = _adam(mu, nu, g_eq, b1, b2, t)
    d = mu_hat / (np.sqrt(nu_hat) + eps)
    u_a, u_b, _ = adjusted(A, B, s * B.T @ d, s * d @ A.T, s, ridge)
    shrink = np.sqrt(1 - lr * wd)
    return (shrink * A - lr * u_a).T, (shrink * B - lr * u_b).T, mu, nu
  u_a, u_b, _ = adjusted(A, B, gA, gB, s, ridge)  # "efficient": AdamW on the adjusted gradients
  ma, va, mha, vha = _adam(mu[0], nu[0], u_a.T, b1, b2, t)
  mb, vb, mhb, vhb = _adam(mu[1], nu[1], u_b.T, b1, b2, t)
  a_new = a - lr * (mha / (np.sqrt(vha) + eps) + wd * a)
  b_new = b - lr * (mhb / (np.sqrt(vhb) + eps) + wd * b)
  return a_new, b_new, (ma, mb), (va, vb)
