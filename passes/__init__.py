"""The built-in passes, by name, in the order of the default compile recipe.

Each value is `module:Class`, imported only when the registry is built.
"""

BUILTIN_PASSES = {
    "load": "passes.load:LoadPass",
    "inline-calls": "passes.inline_calls:InlineCallsPass",
    "flatten-params": "passes.flatten_params:FlattenParamsPass",
    "cost-analysis": "passes.cost_analysis:CostAnalysisPass",
    "batch-analysis": "passes.batch_analysis:BatchAnalysisPass",
    "step-split": "passes.step_split:StepSplitPass",
    "stage-construction": "passes.stage_construction:StageConstructionPass",
    "intra-op-sharding": "passes.intra_op:IntraOpShardingPass",
    "reduce-scatter": "passes.reduce_scatter:ReduceScatterPass",
    "emit": "passes.emit:EmitPass",
}
