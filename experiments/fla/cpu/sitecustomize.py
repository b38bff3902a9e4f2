"""Lets fla's Triton kernels run under Triton's CPU interpreter, for the CPU smoke run of
experiments/fla-*.yaml only: the experiment's `cpu.python_path` puts this folder on PYTHONPATH of
the processes a CPU run starts (never on a GPU run), and Python imports `sitecustomize` at start.
Without TRITON_INTERPRET=1 it does nothing. Nothing in fla is changed; two interpreter gaps are
bridged (../shared/notes/cpu-ci.md):

- an autotuned kernel with two or more configs benchmarks them through the GPU driver ("0 active
  drivers"): under the interpreter each call runs the first config that survives the kernel's own
  pruning, benchmarking none (timings under the interpreter say nothing about a GPU anyway);
- a `for i in range(n)` loop variable, and `min(a, b)` / `max(a, b)` of a Python int, are Python
  ints under the interpreter, so fla's `i.to(tl.int64)` and `min(NC, ...).to(tl.int32)` raise
  AttributeError: the interpreter's rewrite of each kernel's source (which already turns the value
  of every assignment into a tensor) also turns each loop variable and each min/max into one.
"""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    import ast

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import ASTTransformer

    _autotuned_run = Autotuner.run

    def _first_config_run(self, *args, **kwargs):
        if len(self.configs) <= 1:
            return _autotuned_run(self, *args, **kwargs)
        self.nargs = dict(zip(self.arg_names, args))
        first = self.prune_configs(kwargs)[0]
        every, self.configs = self.configs, [first]
        try:
            return _autotuned_run(self, *args, **kwargs)
        finally:
            self.configs = every

    def _loop_variable_as_tensor(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            node.body.insert(0, ast.parse(f"{name} = interpreter_semantic.to_tensor({name}, False)").body[0])
        return node

    def _min_max_as_tensor(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                      ctx=ast.Load())
            return ast.Call(func=to_tensor, args=[node, ast.Constant(value=False)], keywords=[])
        return node

    _assignment = ASTTransformer.visit_Assign

    def _assignment_visiting_its_value(self, node):
        node.value = self.visit(node.value)  # the interpreter's own rewrite leaves the value unvisited
        return _assignment(self, node)

    Autotuner.run = _first_config_run
    ASTTransformer.visit_For = _loop_variable_as_tensor
    ASTTransformer.visit_Call = _min_max_as_tensor
    ASTTransformer.visit_Assign = _assignment_visiting_its_value
