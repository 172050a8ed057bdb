"""The built-in passes, by name, in the order of the default compile recipe.

Each value is `module:Class`, imported only when the registry is built.
"""

BUILTIN_PASSES = {
    "load": "passes.load:LoadPass",
    "inline-calls": "passes.inline_calls:InlineCallsPass",
    "cost-analysis": "passes.cost_analysis:CostAnalysisPass",
}
