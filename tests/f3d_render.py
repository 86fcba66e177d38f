"""Render a model file with F3D (PyPI ``f3d``, its Python bindings) offscreen through EGL, from one camera:
``python f3d_render.py MODEL OUT.npy JSON``, JSON = {"width", "height", "position", "focal_point", "view_up",
"view_angle" (vertical, degrees), "background" [r, g, b], "options" {libf3d option: value}}; without "position",
F3D's own camera (as its command line sets it: fitted to the model, looking along its axes). Writes the
image as uint8 [H, W, 3], top row first. A separate process: the f3d wheel brings its own OpenSSL, which
cannot load after torch has loaded the system's."""
import json
import sys

import f3d
import numpy as np


def main(model: str, out: str, spec: str) -> None:
    s = json.loads(spec)
    engine = f3d.Engine.create_egl()
    options = engine.options
    options["render.background.color"] = [float(c) for c in s["background"]]
    for key, value in s["options"].items():
        options[key] = value
    engine.window.size = (int(s["width"]), int(s["height"]))
    engine.scene.add(model)
    camera = engine.window.camera
    if "position" not in s:                                          # F3D's own camera, as its command line has it
        camera.reset_to_bounds()
    else:
        camera.position = tuple(s["position"])
        camera.focal_point = tuple(s["focal_point"])
        camera.view_up = tuple(s["view_up"])
        camera.view_angle = float(s["view_angle"])
    image = engine.window.render_to_image()
    pixels = np.frombuffer(bytes(image.content), np.uint8).reshape(image.height, image.width, image.channel_count)
    np.save(out, np.ascontiguousarray(pixels[::-1, :, :3]))          # F3D's rows run bottom to top


if __name__ == "__main__":
    main(*sys.argv[1:4])
