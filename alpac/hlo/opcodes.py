"""The opcode table: what each HLO opcode is, one named class per property, each defined once.

A class says what XLA's HLO makes an opcode (elementwise, a view, a collective, the `*-done`
half of an asynchronous pair, ...), and why it belongs there. What an analysis *does* with an
opcode is that analysis's policy and stays in its module (which ops the sharding strategies
follow, which ops the microbatch rewrite can shrink, ...), built from these classes instead of
re-listing their members. Names are opcodes as XLA prints them (`opt-barrier`, not
`optimization-barrier`); the classes at the end are custom-call targets, not opcodes.
"""

from __future__ import annotations

# ---- elementwise: each output element from the same position of every operand --------------

# (stochastic-convert also reads random bits: a second operand of the operand's shape)
ELEMENTWISE_UNARY = frozenset({
    "abs", "cbrt", "ceil", "convert", "copy", "cosine", "count-leading-zeros", "erf",
    "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one",
    "logistic", "negate", "not", "popcnt", "real", "reduce-precision", "round-nearest-afz",
    "round-nearest-even", "rsqrt", "sign", "sine", "sqrt", "tan", "tanh", "bitcast-convert",
    "stochastic-convert",
})
ELEMENTWISE_BINARY = frozenset({
    "add", "atan2", "and", "complex", "compare", "divide", "maximum", "minimum", "multiply",
    "or", "power", "remainder", "shift-left", "shift-right-arithmetic", "shift-right-logical",
    "subtract", "xor",
})
ELEMENTWISE_TERNARY = frozenset({"select", "clamp"})
ELEMENTWISE = ELEMENTWISE_UNARY | ELEMENTWISE_BINARY | ELEMENTWISE_TERNARY
# the elementwise ops XLA's HloCostAnalysis counts as transcendentals, not flops
TRANSCENDENTAL = frozenset({
    "cosine", "erf", "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic",
    "power", "rsqrt", "sine", "sqrt", "tan", "tanh", "cbrt", "atan2",
})
# unary elementwise ops that carry every value over as it is (convert: into another type)
VALUE_COPIES = frozenset({"copy", "convert"})

# ---- data movement: no arithmetic -------------------------------------------------------------

# the same elements in the same (row-major) order under other dimensions
RESHAPES = frozenset({"reshape", "bitcast"})
# rearrange elements and compute nothing (XLA makes them bitcasts where the layouts line up)
VIEWS = RESHAPES | {"transpose"}
# read only the part of their first operand that they output (plus their indices)
SLICES = frozenset({"slice", "dynamic-slice", "gather"})
# make their result from a literal, an index or a smaller operand: cheaper to make again where
# it is needed than to receive
GENERATORS = frozenset({"constant", "iota", "broadcast"})
# what XLA's loop fusion runs inside the kernel of their user (alpac.analysis.fusion; the
# sharding builder's buffers)
LOOP_FUSIBLE = ELEMENTWISE | GENERATORS | VIEWS | {"slice"}

# ---- computing ops with a structure of their own ----------------------------------------------

# contract operands against each other: the FLOPs of a model, what Alpa cuts layers around
CONTRACTIONS = frozenset({"dot", "convolution"})

# slide a window= over their first operand and apply a scalar computation per window
WINDOW_REDUCTIONS = frozenset({"reduce-window", "select-and-scatter"})
# combine many elements into fewer with a reducer computation
REDUCTIONS = WINDOW_REDUCTIONS | {"reduce"}
BATCH_NORM = frozenset({"batch-norm-training", "batch-norm-inference", "batch-norm-grad"})
# XLA hands them to a library routine over whole arrays (cuSOLVER/LAPACK, cuFFT)
LIBRARY_CALLS = frozenset({"cholesky", "triangular-solve", "fft"})
# draw random numbers (rng-bit-generator from an explicit state, rng from the hidden one)
RANDOM = frozenset({"rng", "rng-bit-generator"})
# run their called computations a data-dependent number of times, or pick one of them
CONTROL_FLOW = frozenset({"while", "conditional"})

# ---- values that are not data -----------------------------------------------------------------

# return their operand unchanged: they only constrain scheduling (opt-barrier, add-dependency)
# or mark a sharding domain
PASS_THROUGH = frozenset({"opt-barrier", "domain", "add-dependency"})
# their value depends on the device that runs them
DEVICE_IDS = frozenset({"partition-id", "replica-id"})
# read or set the dynamic size of a dimension
DYNAMIC_SHAPES = frozenset({"get-dimension-size", "set-dimension-size"})
# talk to the host or over a channel
HOST_IO = frozenset({"infeed", "outfeed", "send", "recv", "send-done", "recv-done"})
# kept by dead-code elimination even when nothing uses them: I/O, token joins and the rng with
# hidden state
SIDE_EFFECTING = HOST_IO | {"after-all", "rng", "rng-get-and-update-state"}

# ---- collectives and asynchronous pairs -------------------------------------------------------

# the devices of each replica group exchange data
COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                         "collective-permute", "collective-broadcast"})
# collectives whose asynchronous form is a `-start`/`-done` pair of opcodes of its own
ASYNC_COLLECTIVES = frozenset({"all-reduce", "all-gather", "collective-permute"})
COLLECTIVE_STARTS = frozenset(op + "-start" for op in ASYNC_COLLECTIVES)
COLLECTIVE_DONES = frozenset(op + "-done" for op in ASYNC_COLLECTIVES)
# every opcode of a collective: synchronous, or either half of an asynchronous one
COLLECTIVE_OPS = COLLECTIVES | COLLECTIVE_STARTS | COLLECTIVE_DONES
# the collectives alpac plans with, prices and counts in what XLA partitioned (alpac never
# plans a collective-broadcast)
PLANNED_COLLECTIVES = COLLECTIVES - {"collective-broadcast"}
# asynchronous pairs that only XLA's scheduling passes create: the generic wrapper of any op,
# and the asynchronous copy
ASYNC_WRAPPER = frozenset({"async-start", "async-update", "async-done"})
COPY_PAIR = frozenset({"copy-start", "copy-done"})
SCHEDULED_ASYNC = ASYNC_WRAPPER | COPY_PAIR
# the second halves of asynchronous pairs: they wait for what their start began, and move and
# compute nothing themselves
ASYNC_DONES = frozenset({"async-done", "copy-done", "send-done", "recv-done"}) | COLLECTIVE_DONES

# ---- custom-call targets ----------------------------------------------------------------------

# sharding annotations: return their operand as it is and compile to nothing
SHARDING_ANNOTATIONS = frozenset({"Sharding", "xla.sdy.FuncResultSharding"})
# return their operand's value, but XLA may move it or lay it out again (host offloading, a
# layout constraint, an identity host callback), so they are not free
VALUE_PRESERVING_CALLS = frozenset({
    "annotate_device_placement", "MoveToHost", "MoveToDevice", "LayoutConstraint",
    "xla_python_cpu_callback_identity",
})
# custom-calls that pass their one operand through unchanged: every analysis treats them as
# the identity
IDENTITY_CUSTOM_CALLS = SHARDING_ANNOTATIONS | VALUE_PRESERVING_CALLS
# the edges of a manually partitioned region: the shape changes between the whole array and
# one device's part, but no data moves; not the identity
SPMD_SHAPE_CALLS = frozenset({
    "SPMDFullToShardShape", "SPMDShardToFullShape", "xla.sdy.GlobalToLocalShape",
    "xla.sdy.LocalToGlobalShape",
})
# everything XLA's SPMD partitioner consumes: they compile to nothing
PARTITIONER_CALLS = SHARDING_ANNOTATIONS | SPMD_SHAPE_CALLS | {"xla.sdy.ShardingGroup"}
