import nnbridge


def test_public_api_is_pinned():
    assert sorted(nnbridge.__all__) == sorted([
        "AddPatch", "CompiledGraphModule", "LanguageModel", "NNsight", "TransformersModel", "CustomPatch", "ExtractionError", "ExtractionOptions",
        "FallbackWarning", "MultiplyInvokedModule", "NNBridgeError", "NNBridgeWarning", "NodePath", "NodePathError",
        "OpPoint", "OpaqueGraphModule", "Patch", "PatchableGraph", "ProbePatch", "RecordPatch",
        "ReplacePatch", "SaveLoadError", "SurgeryError", "PassCheckError", "PatternError", "ZeroPatch", "bridge", "unbridge", "explain", "Explanation",
    ])
    for name in nnbridge.__all__:
        assert getattr(nnbridge, name) is not None


def test_error_hierarchy():
    assert issubclass(nnbridge.NodePathError, KeyError)
    assert issubclass(nnbridge.NodePathError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.ExtractionError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.SaveLoadError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.SurgeryError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.PassCheckError, nnbridge.NNBridgeError)
    assert issubclass(nnbridge.PatternError, nnbridge.SurgeryError)
    assert issubclass(nnbridge.NNBridgeWarning, UserWarning)
    assert issubclass(nnbridge.FallbackWarning, nnbridge.NNBridgeWarning)


def test_bridge_is_the_in_place_function_and_no_package():
    """``nnbridge.bridge`` is the in-place function; the machinery lives in packages of its own
    names (no callable package, as ``torch.export`` and ``torch._export``)."""
    import importlib
    import types

    import pytest

    from nnbridge.inplace.bridging import bridge as bridge_function

    assert nnbridge.bridge is bridge_function and isinstance(bridge_function, types.FunctionType)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nnbridge.bridge")
