"""Constant folding on an exported graph: what depends on constants alone (and on inputs' static shapes) is computed
once, at export, instead of on every call.

Swin builds its shifted-window attention mask on every call, 100-odd ops left outside XNNPACK; Swin V2 also clones
each qkv bias and zeroes its key third on every call, and quantized, a Linear whose bias is computed at run time is
not delegated whole: its per-channel weight dequantize falls outside XNNPACK, where ExecuTorch has no kernel for it
("Missing out variants: quantized_decomposed::dequantize_per_channel")."""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

# ops that read a tensor for its shape, dtype and device only (Swin builds its shifted-window mask with x.new_zeros)
SHAPE_ONLY = {
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.new_full.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.full_like.default,
}
SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
# ops whose schema promises a new tensor but that return their input itself when there is nothing to do
MAY_RETURN_INPUT = {
    torch.ops.aten.dropout.default,
    torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
    torch.ops.aten.type_as.default,
    torch.ops.aten.atleast_1d.default,
    torch.ops.aten.atleast_2d.default,
    torch.ops.aten.atleast_3d.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsafe_split.Tensor,
    torch.ops.aten.unsafe_chunk.default,
    torch.ops.aten.contiguous.default,
}


def fold_constants(module: GraphModule) -> tuple[GraphModule, int]:
    """Fold in place; returns the module and how many tensors were folded (0: the graph is untouched).

    In-place ops (Swin fills its mask slice by slice) run in graph order, and each read of a folded tensor gets the
    value it has where that read is. A tensor that an op on the inputs writes into (`out = x.new_zeros(...);
    out[:, :3] = x`) is not a constant, nor is anything that shares its storage. A graph that would change the
    module's own parameters or buffers is left as it is."""
    nodes = list(module.graph.nodes)
    root = _roots(nodes)
    live = _live(nodes, root)
    own = {_storage(t) for t in [*module.parameters(), *module.buffers()]}
    values, changes, snapshots, reads = {}, {}, {}, []
    for node in nodes:
        if node in live:
            for arg in node.all_input_nodes:
                if _folds(arg, root) and isinstance(values.get(arg), torch.Tensor):
                    key = (arg, changes.get(root[arg], 0))  # a write elsewhere does not copy this tensor again
                    if key not in snapshots:
                        snapshots[key] = values[arg].detach().clone()
                    reads.append((node, arg, key))
            continue
        if node.op == "get_attr":
            values[node] = _attr(module, node.target)
        elif node.op == "call_function":
            if _is_random(node):
                return module, 0  # a random draw is not a constant
            for target in _written(node):
                if root[target].op != "call_function" or _storage(values[target]) in own:
                    return module, 0  # it would change the model's own tensors
                changes[root[target]] = changes.get(root[target], 0) + 1
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _value(n, values))
            try:
                with torch.no_grad():
                    values[node] = node.target(*args, **kwargs)
            except (RuntimeError, TypeError, NotImplementedError):
                return module, 0  # not evaluable outside the graph: left as it is, unfolded
            if _unexpected_alias(node, values, root):
                return module, 0  # the roots above are wrong about this op: nothing they say can be trusted
    if not reads:
        return module, 0
    graph, constants, stored = module.graph, {}, []
    for user, arg, key in reads:
        if key not in constants:  # equal tensors stored once (Swin's shifted blocks of a stage build equal masks)
            constants[key] = next((node for node, value in stored if _equal(value, snapshots[key])), None)
        if constants[key] is None:
            name = f"_folded_constant_{len(stored)}"
            module.register_buffer(name, snapshots[key])
            with graph.inserting_before(user):
                constants[key] = graph.get_attr(name)
            constants[key].meta = dict(arg.meta)
            stored.append((constants[key], snapshots[key]))
        if user.op == "output":  # returned as a copy: a caller changing its output must not change the constant
            with graph.inserting_before(user):
                copy = graph.call_function(torch.ops.aten.clone.default, (constants[key],))
            copy.meta = dict(arg.meta)
            user.replace_input_with(arg, copy)
        else:
            user.replace_input_with(arg, constants[key])
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node in values and not node.users:
            graph.erase_node(node)
    graph.lint()
    module.recompile()
    return module, len(stored)


def unread_writes(module: GraphModule) -> list[Node]:
    """In-place ops whose own result nobody reads: what they write is read through another node."""
    return [node for node in module.graph.nodes if node.op == "call_function" and _written(node) and not node.users]


def _roots(nodes: list[Node]) -> dict[Node, Node]:
    """The node whose storage each node's value shares: itself, or through views (and getitem of an unbind or
    split, which are views too) the tensor they view. An op that may hand back its input as it is, though its
    schema promises a new tensor (eval-mode dropout, type_as), counts as a view of it."""
    root = {}
    for node in nodes:
        source = _aliased_input(node)
        root[node] = root.get(source, source) if source is not None else node
    return root


def _aliased_input(node: Node) -> Node | None:
    if node.op != "call_function" or not node.args:
        return None
    first = node.args[0] if isinstance(node.args[0], Node) else None
    if node.target is operator.getitem or node.target in MAY_RETURN_INPUT:
        return first
    schema = _schema(node)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    returned = schema.returns[0].alias_info.before_set
    for i, argument in enumerate(schema.arguments):  # `out=` ops return their `out`, not their first argument
        if argument.alias_info is not None and argument.alias_info.before_set == returned:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, Node) else None
    return first


def _live(nodes: list[Node], root: dict) -> set[Node]:
    """Nodes computed at run time: the inputs, what reads their values, anything stored in a tensor that such a node
    writes into (to a fixed point), Python scalars (they cannot become a constant tensor) and the output."""
    written = set()
    while True:
        live = set()
        for node in nodes:
            if (
                node.op in ("placeholder", "output")
                or root[node] in written
                or _higher_order(node)
                or node.op == "call_function"
                and isinstance(node.meta.get("val"), SCALARS)
                or node.op != "get_attr"
                and _reads_values(node, live)
            ):
                live.add(node)
        more = {root[target] for node in live for target in _written(node)}
        # a live op may hand back a constant it takes without saying so (broadcast_tensors, einsum): what is
        # written through its output may be that constant
        more |= {
            root[arg]
            for written_root in more
            if written_root in live and written_root.op == "call_function"
            for arg in written_root.all_input_nodes
            if root[arg].op == "call_function"
        }
        more -= written
        if not more:
            return live
        written |= more


def _folds(node: Node, root: dict) -> bool:
    """A plain view of a parameter stays in the graph: folded, `bias.expand(y.shape)` would store the broadcast."""
    return node.op == "call_function" and not (root[node] is not node and root[node].op == "get_attr")


def _reads_values(node: Node, live: set) -> bool:
    """Whether `node` depends on a live tensor's values (not only on the static shape of one)."""
    if node.op == "call_function" and node.target in SHAPE_ONLY:
        val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        static = isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape)
        rest = [a for a in node.all_input_nodes if a is not node.args[0]]
        return not static or any(a in live for a in rest)
    return any(a in live for a in node.all_input_nodes)


def _written(node: Node) -> list[Node]:
    """The tensors an in-place op writes into; every tensor a higher-order op takes (its body is not looked into)."""
    if _higher_order(node):
        return list(node.all_input_nodes)
    schema = _schema(node)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, argument in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, Node):
            out.append(value)
    return out


def _unexpected_alias(node: Node, values: dict, root: dict) -> bool:
    """Whether `node`'s value shares memory with an input it is not known to view (meshgrid hands back its inputs)."""
    outputs = [t for t in torch.utils._pytree.tree_leaves(values[node]) if isinstance(t, torch.Tensor)]
    storages = {_storage(t) for t in outputs if t.untyped_storage().nbytes()}
    return any(
        isinstance(values.get(arg), torch.Tensor) and root[arg] is not root[node] and _storage(values[arg]) in storages
        for arg in node.all_input_nodes
    )


def _higher_order(node: Node) -> bool:
    """`torch.no_grad()`, `autocast` or `cond` inside forward: a call of a subgraph."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _is_random(node: Node) -> bool:
    if _schema(node) is None or torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    # eval-mode dropout is tagged random like any dropout, and is the identity
    return not (node.target is torch.ops.aten.dropout.default and _arg(node, 2, "train", True) is False)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: torch.equal takes -0.0 for 0.0 (atan2 tells them apart)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    return torch.equal(a.view(bits), b.view(bits)) if bits is not None and a.is_contiguous() else torch.equal(a, b)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _value(node: Node, values: dict):
    """A folded node's value; a live tensor here is read for its shape alone."""
    if node in values:
        return values[node]
    return torch.zeros(node.meta["val"].shape, dtype=node.meta["val"].dtype)


def _schema(node: Node):
    return node.target._schema if isinstance(node.target, torch._ops.OpOverload) else None


def _attr(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _arg(node: Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
