"""`alpac calibrate`'s probes of the host's work around a module execution, as alpa-run does
it: launching one and waiting for it, each array it takes and returns, feeding an input,
freeing an array, and the CPU a rank spends launching after a wait and polling (the
`calibration:` scalars, alpac.plan.calibration). A mixin of `alpac.runtime.probes.Rank`."""

from __future__ import annotations

import time

import numpy as np

from alpac.plan.calibration import POLL_FIRST_S
from alpac.runtime.probe_programs import feeding, freeing
from alpac.runtime.timing import per_op

IDLE = 1e-3  # seconds a rank sleeps before each launch of `launch_cpu`
FREED = 16  # arrays `free` deletes after each module, as a task of a plan frees several


class HostProbes:
    """The host's figures; `Rank` gives `comm`, `jax`, `local`, `_timed` and
    `busy_until_released`."""

    def _tiny(self, devices=None):
        """A tiny module on the rank's devices (or `devices`), compiled the way alpa-run
        compiles a module (the XLA bridge), and its argument."""
        from alpac.xla.bridge import compile_hlo, jax_parameter_shardings
        exe = compile_hlo("HloModule tiny\nENTRY e {\n  p = f32[1] parameter(0)\n"
                          "  c = f32[1] constant({1})\n  ROOT a = f32[1] add(p, c)\n}\n",
                          self.local if devices is None else devices)
        return exe, self.jax.device_put(np.zeros(1, np.float32),
                                        jax_parameter_shardings(exe)[0])

    def launch(self, devices=None) -> float:
        """The tiny module (`_tiny`) executed and waited for, again and again."""
        from alpac.xla.bridge import execute_unchecked
        exe, x = self._tiny(devices)

        def run(r):
            for _ in range(r):
                execute_unchecked(exe, [x])[0].block_until_ready()
        seconds = self._timed(run)
        if devices is None:
            self.launch_s = seconds
        return seconds

    def launch_cpu(self, devices=None) -> float:
        """CPU seconds, all of the process's threads, of the tiny module launched and waited
        for after the rank slept `IDLE` seconds (as a pipeline's rank launches each module
        after waiting for a message), the sleep's own CPU time taken off. Back to back a
        launch on 2 CPU devices took 53 µs of CPU here, after a sleep 150-240 µs: the
        devices' threads wake and spin again each time."""
        from alpac.xla.bridge import execute_unchecked
        exe, x = self._tiny(devices)

        def run(r):
            start = time.process_time()
            for _ in range(r):
                time.sleep(IDLE)
                execute_unchecked(exe, [x])[0].block_until_ready()
            launched = time.process_time()
            for _ in range(r):
                time.sleep(IDLE)
            return max(2 * launched - start - time.process_time(), 1e-7)
        return self._timed(run)

    def pause(self, kind: str) -> float:
        """One sleep of alpa-run's polling (POLL_FIRST_S asked): its CPU seconds
        (`pause_cpu_s`) or how long it lasts (`pause_s`); here 15-25 µs of CPU and ~90 µs."""
        def run(r):
            start = time.process_time()
            for _ in range(r):
                time.sleep(POLL_FIRST_S)
            return max(time.process_time() - start, 1e-7) if kind == "pause_cpu_s" else None
        return self._timed(run)

    def alone(self, kind: str) -> float | None:
        """`launch`, `arrays`, `arguments` or `launch_cpu` on rank 0's first device, every
        other device idle (a plan on one device; the host's share of a plan on a few,
        `Calibration.host_seconds`). None on the other ranks, which keep step."""
        if kind in ("array_alone_s", "argument_alone_s"):
            figure = (self._array_s if kind == "array_alone_s" else self._argument_s)(True)
            return None if self.comm.rank else figure
        if self.comm.rank:
            self._timed(lambda r: None)
            if kind == "launch_alone_s":
                self.launch_alone_s = 0.0
            return None
        one = self.local[:1]
        if kind == "launch_cpu_alone_s":
            return self.launch_cpu(one)
        self.launch_alone_s = self.launch(one)
        return self.launch_alone_s

    def arrays(self, count: int = 64, devices=None) -> float:
        """Beyond `launch`, each more array a module execution returns with the argument it
        replaces (the host's work per result: its buffer, its jax array, waiting for it),
        from a module that returns `count` arrays in place of the ones it took (aliased: no
        kernel runs), against one that returns two."""
        from alpac.xla.bridge import execute_unchecked
        devices = self.local if devices is None else devices

        def timed(n: int) -> float:
            exe, held = self._passing(n, n, devices)

            def run(r):
                nonlocal held
                for _ in range(r):
                    held = execute_unchecked(exe, held)
                    for a in held:
                        a.block_until_ready()
            return self._timed(run)
        return max(timed(count) - timed(2), 0.0) / (count - 2)

    def arguments(self, count: int = 64, devices=None) -> float:
        """Beyond `launch`, each more argument a module execution takes, handed over as
        alpa-run hands a task's arguments to its module (`handed_over`: found in the rank's
        arrays, its layout checked against the one the module expects), from a module of
        `count` arguments that returns two, against one of two. Here ~1.4 µs each, 0.8 of
        them in the execution."""
        from alpac.runtime.executor import handed_over
        from alpac.runtime.timeline import Read
        from alpac.runtime.transfers import SameLayout
        from alpac.xla.bridge import execute_unchecked, jax_parameter_shardings
        devices = self.local if devices is None else devices

        def timed(n: int) -> float:
            exe, held = self._passing(n, 2, devices)
            expected, same_layout = jax_parameter_shardings(exe), SameLayout()
            slots = {(f"p{i}", None, 0): a for i, a in enumerate(held)}
            reads = [Read(i, key, 0, False) for i, key in enumerate(slots)]

            def run(r):
                for _ in range(r):
                    args = handed_over(reads, slots, expected, (), same_layout, None)
                    for read, a in zip(reads, execute_unchecked(exe, args)):  # in place
                        slots[read.key] = a
                        a.block_until_ready()
            return self._timed(run)
        return max(timed(count) - timed(2), 0.0) / (count - 2)

    def _passing(self, n: int, returned: int, devices) -> tuple:
        """A module that takes `n` small arrays and returns the first `returned` of them in
        their place (aliased: no kernel runs), compiled by the XLA bridge, and its arguments
        on `devices`."""
        from alpac.xla.bridge import compile_hlo, jax_parameter_shardings
        shape = f"f32[{len(devices)}]"
        params = "\n".join(f"  p{i} = {shape} parameter({i})" for i in range(n))
        alias = ", ".join(f"{{{i}}}: ({i}, {{}}, must-alias)" for i in range(returned))
        exe = compile_hlo(f"HloModule passing{n}, input_output_alias={{ {alias} }}\n"
                          f"ENTRY e {{\n{params}\n  ROOT t = ({', '.join([shape] * returned)}) "
                          f"tuple({', '.join(f'p{i}' for i in range(returned))})\n}}\n",
                          devices)
        return exe, [self.jax.device_put(np.zeros(len(devices), np.float32), s)
                     for s in jax_parameter_shardings(exe)]

    def while_others_busy(self, measure) -> float | None:
        """`measure()` on rank 0 while the other ranks keep their devices busy
        (`busy_until_released`): alpa-run feeds and frees on one mesh while the other meshes
        of a pipeline compute, and on a shared CPU that host work then waits for a core. Here
        a feed measured 0.03-0.06 ms so (0.03 with the other rank idle); inside a two-stage
        MLP pipeline, whose other rank runs larger modules, 0.12 ms."""
        if self.comm.rank:
            return self.busy_until_released()
        try:
            return measure()
        finally:
            self._release_busy(1)

    def feed(self) -> float:
        """Feeding one input from the host onto the rank's devices (`feeding`)."""
        return per_op(feeding(self.jax, self.local), lambda r: r)

    def free(self) -> float:
        """Freeing one array as alpa-run frees a module's result (`freeing`)."""
        return freeing(self.jax, self.local, FREED, rounds=24)

    def _once(self, key: str, alone: bool, measure) -> float:
        """`measure(devices)` on the rank's devices, or on rank 0's first alone (the other
        ranks keep step: two timings, as `arrays` and `arguments` take), measured once."""
        if key not in self._host:
            if alone and self.comm.rank:
                for _ in range(2):
                    self._timed(lambda r: None)
                self._host[key] = 0.0
            else:
                self._host[key] = measure(devices=self.local[:1] if alone else None)
        return self._host[key]

    def _pair_s(self, alone: bool) -> float:
        """`arrays`: an array returned and the argument it replaces."""
        return self._once("pair_alone" if alone else "pair", alone, self.arrays)

    def _argument_s(self, alone: bool) -> float:
        return self._once("argument_alone" if alone else "argument", alone, self.arguments)

    def _array_s(self, alone: bool) -> float:
        """An array returned, without the argument `arrays` takes for it (noise never leaves
        less than half the pair)."""
        pair = self._pair_s(alone)
        return max(pair - self._argument_s(alone), pair / 2)
