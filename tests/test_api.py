import nnbridge


def test_public_api_is_pinned():
    assert sorted(nnbridge.__all__) == sorted([
        "AddPatch", "CompiledGraphModule", "LanguageModel", "NNsight", "TransformersModel", "CustomPatch", "ExtractionError", "ExtractionOptions",
        "MultiplyInvokedModule", "NNBridgeError", "NNBridgeWarning", "NodePath", "NodePathError",
        "OpPoint", "OpaqueGraphModule", "Patch", "PatchableGraph", "ProbePatch", "RecordPatch",
        "ReplacePatch", "SaveLoadError", "ZeroPatch", "bridge", "unbridge", "explain", "Explanation",
    ])
    for name in nnbridge.__all__:
        assert getattr(nnbridge, name) is not None


def test_error_hierarchy():
    assert issubclass(nnbridge.NodePathError, KeyError)
    assert issubclass(nnbridge.NodePathError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.ExtractionError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.SaveLoadError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.NNBridgeWarning, UserWarning)


def test_bridge_is_the_callable_subpackage():
    import importlib
    import types

    import nnbridge.bridge.extraction as extraction  # a module path through nnbridge.bridge imports
    import nnbridge.bridge as package
    from nnbridge.bridge import extract  # noqa: F401
    from nnbridge.bridge.in_place import bridge as bridge_function

    assert isinstance(nnbridge.bridge, types.ModuleType) and callable(nnbridge.bridge)
    assert package is nnbridge.bridge is importlib.import_module("nnbridge.bridge")
    assert package.PatchableGraph is nnbridge.PatchableGraph
    assert extraction.__name__ == "nnbridge.bridge.extraction"
    assert bridge_function.__module__ == "nnbridge.bridge.in_place"
