"""The built-in passes, by name, in the order of the default compile recipe.

Each value is `module:Class`, imported only when the registry is built.
"""

BUILTIN_PASSES = {
    "load": "alpac.passes.load:LoadPass",
    "inline-calls": "alpac.passes.inline_calls:InlineCallsPass",
    "flatten-params": "alpac.passes.flatten_params:FlattenParamsPass",
    "cost-analysis": "alpac.passes.cost_analysis:CostAnalysisPass",
    "batch-analysis": "alpac.passes.batch_analysis:BatchAnalysisPass",
    "step-split": "alpac.passes.step_split:StepSplitPass",
    "unroll-layer-loops": "alpac.passes.unroll_layer_loops:UnrollLayerLoopsPass",
    "stage-construction": "alpac.passes.stage_construction:StageConstructionPass",
    "intra-op-sharding": "alpac.passes.intra_op:IntraOpShardingPass",
    "reduce-scatter": "alpac.passes.reduce_scatter:ReduceScatterPass",
    "emit": "alpac.passes.emit:EmitPass",
}
