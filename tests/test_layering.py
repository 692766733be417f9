"""The engine, config and the Ray-free data paths import no Ray (docs/architecture.md: the engine is Ray-free and unit-testable)."""

import subprocess
import sys


def test_engine_config_and_data_do_not_import_ray():
    code = "import sys, raytrain_loops.engine, raytrain_loops.config, raytrain_loops.data; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
