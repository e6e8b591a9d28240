"""The IR: graph modules, op points, node metadata and NodePaths.

An extracted module is a hierarchy of graph modules shaped like the original module:

- a *compiled* graph module (:class:`~.graph_module.CompiledGraphModule`) runs one ``torch.fx``
  graph of one submodule invocation;
- an *opaque* module (:class:`~.graph_module.OpaqueGraphModule`) runs the module's own code and
  reaches its children's graphs;
- a *multiply invoked* module (:class:`~.graph_module.MultiplyInvokedModule`) holds one graph per
  invocation (``linear_0``, ``linear_1``, as graphpatch numbered them).

Every graph node has an *op point* (:class:`~.op_point.OpPoint`), an identity ``nn.Module`` that
is the one hook point for patches, torch hooks and nnsight envoys. A *listener* is anything
registered on an op point; generated code routes a node through its op point only while it has one.
A *NodePath* (:mod:`.node_path`) names a node (``transformer.h_0.attn.softmax``), with ``|`` to dig
into a container value. *Stateful arguments* (:mod:`.state`) are call arguments a module mutates in
place, such as transformers' ``Cache``; graphs read and write them through :func:`.state.read_state`
and :func:`.state.write_state`.

This layer imports only :mod:`nnbridge.compat` and :mod:`nnbridge.errors`.
"""
