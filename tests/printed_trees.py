"""The kernel ASTs printed during the running test (``kernel_ast.collected_trees``, opened
around each test by the conftest's ``_printed_trees``): ``tree_of(text)`` finds the tree a
renderer printed ``text`` from while the test ran. (A compile keeps its own in the plan,
``KernelPlan.trees``; a plan made by a module-scoped fixture is read there.)"""
PRINTED: dict = {}


def tree_of(text):
    return PRINTED.get(text)
