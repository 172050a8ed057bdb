"""A scanned MLP training step with momentum SGD: 3 layers (tests/golden/unroll-layer-loops),
or as many as the argument says (4: tests/golden/unroll-layer-loops-per-stage)."""
import sys

import jax, jax.numpy as jnp, numpy as np

L = int(sys.argv[1]) if len(sys.argv) > 1 else 3

def step(ws, bs, mw, mb, x, y):
    def loss(ws, bs):
        def layer(h, wb):
            w, b = wb
            return jnp.tanh(h @ w + b), None
        h, _ = jax.lax.scan(layer, x, (ws, bs))
        return jnp.mean((h - y) ** 2)
    value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(ws, bs)
    mw = 0.9 * mw + gw
    mb = 0.9 * mb + gb
    return ws - 0.1 * mw, bs - 0.1 * mb, mw, mb, value

args = (np.zeros((L, 8, 8), np.float32), np.zeros((L, 8), np.float32),
        np.zeros((L, 8, 8), np.float32), np.zeros((L, 8), np.float32),
        np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32))
print(jax.jit(step).lower(*args).as_text(dialect="hlo"))
