"""Sampling settings, the processed distribution p(x) they define, and drawing from it.

Every lossless rule compares distributions produced by ``probs``: the target's p and the draft's q
come from the same processing (temperature, then top-k, then top-p), so "the target's
distribution" always means the processed one. Greedy is temperature 0: p is one-hot at argmax
(first index on ties, as ``jnp.argmax``).

``sample`` takes the model's ``Net``: under the explicit tensor-parallel step its logits come split
over the vocabulary, and greedy and temperature draws never gather them (``tensor_parallel``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxspec.errors import OptionError
from jaxspec.model import tensor_parallel


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise OptionError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if not (0.0 < self.top_p <= 1.0):
            raise OptionError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise OptionError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: Float[Array, "*b v"], s: Sampling) -> Float[Array, "*b v"]:
    """The processed next-token distribution (float32)."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if s.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    logits = logits / s.temperature
    if 0 < s.top_k < v:
        kth = jax.lax.top_k(logits, s.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    p = jax.nn.softmax(logits, axis=-1)
    if s.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (ties by index).
        order = jnp.argsort(-p, axis=-1, stable=True)
        sorted_p = jnp.take_along_axis(p, order, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < s.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[tuple(jnp.indices(order.shape)[:-1]) + (order,)]
            .set(keep_sorted)
        )
        p = jnp.where(keep, p, 0.0)
        p = p / jnp.sum(p, axis=-1, keepdims=True)
    return p


def draw(key, p: Float[Array, "*b v"]) -> Int[Array, "*b"]:
    """One draw per row from a (possibly unnormalised, non-negative) distribution."""
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def sample(key, logits: Float[Array, "*b v"], s: Sampling, net=None) -> Int[Array, "*b"]:
    """One token per row from the processed distribution of ``logits``, the output of ``net``'s
    forward (None: logits on one device, or laid out as GSPMD leaves them)."""
    if net is not None and tensor_parallel.active(net):
        if s.greedy:
            return tensor_parallel.argmax(net, logits)
        if s.top_k == 0 and s.top_p == 1.0:  # Gumbel-max over the split vocabulary
            return tensor_parallel.gumbel_argmax(net, key, logits, s.temperature)
        logits = tensor_parallel.gather(net, logits)  # top-k / top-p rank the whole vocabulary
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draw(key, probs(logits, s))
