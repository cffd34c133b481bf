"""A stand-in for torchvision in the slim SGLang environment (docs/engines.md).

The registry's torchvision is built against CUDA torch and fails to load beside the CPU build ("operator
torchvision::nms does not exist"). SGLang imports it at module level for multimodal processors that a text model
never runs, so any `torchvision.*` module resolves to an empty one whose names are placeholders that raise when
used. No dist-info is installed with it, so transformers keeps reporting torchvision as unavailable.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise NotImplementedError(f"{self._name}: torchvision is a stand-in in this environment")

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        m = _Module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str) -> object:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"torchvision.{attr}")
