"""Run by Python as it starts, when this directory is on PYTHONPATH (dfq_testing/connector_faults.py): with
DFQ_TEST_CONNECTOR_FAULTS set, the import hook that wraps the vLLM extract engine's KV connector with those test
faults is installed; without it nothing is imported or installed. Then the next `sitecustomize` on the path, if
any, is run, as Python would have run it had this one not come first."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install() -> None:
    if not os.environ.get("DFQ_TEST_CONNECTOR_FAULTS", "").strip():
        return
    repo = os.path.dirname(os.path.dirname(_HERE))  # dfq_testing's checkout: last on the path, shadowing nothing
    if importlib.util.find_spec("dfq_testing") is None and repo not in sys.path:
        sys.path.append(repo)
    from dfq_testing.connector_faults import install_import_hook

    install_import_hook()


def _chain() -> None:
    others = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _install()
except Exception:  # Python would print a line and go on without the faults a test counts on
    import traceback

    traceback.print_exc()
    sys.stderr.write("dfq_testing connector_faults_site: the connector faults could not be installed; exiting\n")
    sys.stderr.flush()
    os._exit(70)
_chain()
