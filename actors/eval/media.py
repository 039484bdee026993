"""What an evaluation writes besides its JSON: MP4 videos of episodes and the success chart.

Role: output helpers of ``python -m rlvla3 eval`` (``actors.eval.evaluate``); the driver calls them
where it runs, with frames that travelled back from the eval workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def write_video(path: Path, frames: np.ndarray, fps: int) -> None:
    """H.264 MP4 of ``frames`` ``[T, H, W, 3]`` (PyAV)."""
    import av

    h, w = frames.shape[1] - frames.shape[1] % 2, frames.shape[2] - frames.shape[2] % 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image[:h, :w]), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_chart(
    path: Path, suite: str, per_task: dict[str, dict[str, Any]], overall: float
) -> None:
    """PNG bar chart of the success rate of each task, with its Wilson 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_task)
    rates = np.array([100 * per_task[n]["success_rate"] for n in names])
    low = np.array([100 * per_task[n]["ci95"][0] for n in names])
    high = np.array([100 * per_task[n]["ci95"][1] for n in names])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(names) + 2), 3.2))
    ax.bar(names, rates, color="#4C72B0", yerr=[rates - low, high - rates], capsize=3)
    ax.axhline(
        100 * overall, color="#C44E52", linestyle="--", label=f"overall {100 * overall:.0f}%"
    )
    ax.set_ylim(0, 100)
    ax.set_xlabel(f"{suite} task")
    ax.set_ylabel("success (%, 95% CI)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
