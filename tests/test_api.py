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


def test_bridge_function_and_subpackage_coexist():
    import importlib

    assert callable(nnbridge.bridge) and nnbridge.bridge.__module__ == "nnbridge.bridge.in_place"
    assert importlib.import_module("nnbridge.bridge").PatchableGraph is nnbridge.PatchableGraph
    from nnbridge.bridge import extract  # noqa: F401
