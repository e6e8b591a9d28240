"""Graph layer: module -> hierarchy of fx graphs, NodePaths, patches, PatchableGraph, op points."""
