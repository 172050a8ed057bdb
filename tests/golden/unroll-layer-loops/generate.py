"""A 3-layer scanned MLP training step with momentum SGD (tests/golden/unroll-layer-loops)."""
import jax, jax.numpy as jnp, numpy as np

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

args = (np.zeros((3, 8, 8), np.float32), np.zeros((3, 8), np.float32),
        np.zeros((3, 8, 8), np.float32), np.zeros((3, 8), np.float32),
        np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32))
print(jax.jit(step).lower(*args).as_text(dialect="hlo"))
