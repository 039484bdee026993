"""Convert the Franka Panda that robosuite ships (MJCF) into the USD articulation of our Isaac Lab
tasks: ``envs/isaaclab/assets/panda.usda`` plus ``panda.json`` (joint names, home pose, TCP).

Role: Isaac Lab builds scenes from USD, and its stock Franka is fetched from NVIDIA's content
bucket at run time; ours is converted once, here, from the robot description of a PyPI package
(``robosuite``'s ``robots/panda/robot.xml`` with ``grippers/panda_gripper.xml`` attached at the
hand), and committed. Nothing is fetched when a task runs.

What the conversion keeps and what it changes:
- Kinematics, joint axes and limits, masses and inertias are MuJoCo's compiled values
  (``mujoco.MjSpec`` attaches the gripper; ``MjModel`` resolves every frame). Bodies that no
  joint separates (robosuite's ``base`` and ``link0``, ``right_hand`` and the gripper body,
  each finger and its pad) are merged into one rigid body: masses added, inertias combined by
  the parallel-axis theorem and re-diagonalised.
- Geometry: the collision meshes (robosuite's group 0, a few hundred triangles each) serve as
  both the visual and the collision shapes; a mesh above ``MAX_FACES`` triangles is replaced by
  its convex hull (link 1's has 12,516). Primitive geoms become cubes. Colours are Panda's:
  white links, dark grey joints and hand.
- USD layout (``UsdPhysics``): one ``Xform`` per rigid body under ``/panda`` (the articulation
  root), placed at the model's zero pose; a fixed joint holds ``panda_link0`` to the world;
  the hand is welded to link 7 by a fixed joint (MuJoCo welds it); revolute joints
  ``panda_joint1..7`` (limits in degrees, as USD wants) and prismatic
  ``panda_finger_joint1/2``, each frame at the child body's origin with its axis a principal
  axis of that frame; angular/linear drives (the task's actuator config sets their gains).

Usage (in the Isaac Lab environment, which has ``mujoco`` and ``pxr``; the robosuite assets are
found through ``--robosuite`` or the ``robosuite`` package of any interpreter)::

    ISAACLAB_PY=$(python -m rlvla3 envs path isaaclab)/bin/python
    $ISAACLAB_PY -m envs.isaaclab.build_assets --robosuite \
        "$(python -c 'import robosuite, os; print(os.path.dirname(robosuite.__file__))')"

The output is deterministic: re-running it on the same robosuite release rewrites the same files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ASSETS = Path(__file__).resolve().parent / "assets"
MAX_FACES = 1000
"""Meshes with more triangles than this become their convex hull."""
HULL_POINTS = 200
"""About how many of a fine mesh's vertices its hull is built from (every k-th one)."""

JOINT_NAMES = {
    "joint1": "panda_joint1", "joint2": "panda_joint2", "joint3": "panda_joint3",
    "joint4": "panda_joint4", "joint5": "panda_joint5", "joint6": "panda_joint6",
    "joint7": "panda_joint7", "gripper0_finger_joint1": "panda_finger_joint1",
    "gripper0_finger_joint2": "panda_finger_joint2",
}
BODY_NAMES = {
    "link0": "panda_link0", "link1": "panda_link1", "link2": "panda_link2",
    "link3": "panda_link3", "link4": "panda_link4", "link5": "panda_link5",
    "link6": "panda_link6", "link7": "panda_link7", "right_hand": "panda_hand",
    "gripper0_leftfinger": "panda_leftfinger", "gripper0_rightfinger": "panda_rightfinger",
}
"""MuJoCo body -> USD rigid body; jointless bodies below one are merged into it."""
TCP_BODY = "gripper0_eef"
"""The tool centre point: between the fingertips."""
HOME = {"panda_joint1": 0.0, "panda_joint2": 0.1438, "panda_joint3": 0.0, "panda_joint4": -2.3972,
        "panda_joint5": 0.0, "panda_joint6": 2.5407, "panda_joint7": 0.785,
        "panda_finger_joint1": 0.04, "panda_finger_joint2": -0.04}
"""The start pose: the tool centre point 16 cm above the table at x = 0.5 m, the hand pointing
down, fingers open (solved once by least squares on this model's kinematics)."""
WHITE, DARK = (0.92, 0.92, 0.93), (0.25, 0.25, 0.25)
COLOURS = {"panda_link0": WHITE, "panda_link1": WHITE, "panda_link2": WHITE,
           "panda_link3": WHITE, "panda_link4": WHITE, "panda_link5": WHITE,
           "panda_link6": DARK, "panda_link7": WHITE, "panda_hand": WHITE,
           "panda_leftfinger": DARK, "panda_rightfinger": DARK}


def _quat_wxyz_to_matrix(q: np.ndarray) -> np.ndarray:
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def _matrix_to_quat_wxyz(m: np.ndarray) -> np.ndarray:
    import mujoco

    q = np.zeros(4)
    mujoco.mju_mat2Quat(q, np.ascontiguousarray(m, dtype=np.float64).reshape(9))
    return q if q[0] >= 0 else -q


@dataclass
class Pose:
    """A rigid transform: ``x_world = rot @ x_local + pos``."""

    pos: np.ndarray
    rot: np.ndarray

    def inverse(self) -> Pose:
        return Pose(-self.rot.T @ self.pos, self.rot.T)

    def __matmul__(self, other: Pose) -> Pose:
        return Pose(self.rot @ other.pos + self.pos, self.rot @ other.rot)


@dataclass
class Shape:
    """A geom in its rigid body's frame: a triangle mesh or a box."""

    pose: Pose
    points: np.ndarray | None = None
    faces: np.ndarray | None = None
    box: np.ndarray | None = None
    """Half extents, for a box."""


@dataclass
class Body:
    """A rigid body of the USD articulation, with its merged mass properties (body frame)."""

    name: str
    world: Pose
    mass: float = 0.0
    com: np.ndarray = field(default_factory=lambda: np.zeros(3))
    inertia: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    shapes: list[Shape] = field(default_factory=list)


def _load(robosuite_dir: Path) -> Any:
    import mujoco

    assets = robosuite_dir / "models" / "assets"
    arm = mujoco.MjSpec.from_file(str(assets / "robots" / "panda" / "robot.xml"))
    gripper = mujoco.MjSpec.from_file(str(assets / "grippers" / "panda_gripper.xml"))
    for spec in (arm, gripper):  # robosuite writes radians and sets the compiler in its world
        spec.compiler.degree = False
    arm.body("right_hand").add_frame().attach_body(gripper.body("right_gripper"), "gripper0_", "")
    model = arm.compile()
    data = mujoco.MjData(model)
    mujoco.mj_kinematics(model, data)
    return model, data


def _owner(model: Any, body: int) -> int:
    """The USD body a MuJoCo body merges into: itself if it is one, else its nearest ancestor
    that is (a jointless body moves with its parent)."""
    names = [model.body(i).name for i in range(model.nbody)]
    while names[body] not in BODY_NAMES:
        body = model.body_parentid[body]
    return body


def _mesh(model: Any, mesh_id: int) -> tuple[np.ndarray, np.ndarray]:
    start, count = model.mesh_vertadr[mesh_id], model.mesh_vertnum[mesh_id]
    points = np.array(model.mesh_vert[start:start + count], dtype=np.float64)
    fstart, fcount = model.mesh_faceadr[mesh_id], model.mesh_facenum[mesh_id]
    faces = np.array(model.mesh_face[fstart:fstart + fcount], dtype=np.int64)
    if len(faces) > MAX_FACES:
        from scipy.spatial import ConvexHull

        points = points[:: max(1, len(points) // HULL_POINTS)]  # a coarser hull, deterministic
        hull = ConvexHull(points)
        used = np.unique(hull.simplices)
        remap = {int(old): new for new, old in enumerate(used)}
        faces = np.array([[remap[int(i)] for i in tri] for tri in hull.simplices])
        # orient every hull triangle outwards
        centre = points[used].mean(axis=0)
        points = points[used]
        for k, (a, b, c) in enumerate(faces):
            normal = np.cross(points[b] - points[a], points[c] - points[a])
            if normal @ (points[a] - centre) < 0:
                faces[k] = (a, c, b)
    return points, faces


def _shift(inertia: np.ndarray, mass: float, offset: np.ndarray) -> np.ndarray:
    """An inertia about a point ``offset`` away from the centre of mass (parallel axes)."""
    return inertia + mass * ((offset @ offset) * np.eye(3) - np.outer(offset, offset))


def collect(model: Any, data: Any) -> tuple[dict[str, Body], Pose]:
    """The merged rigid bodies (world poses at the zero configuration) and the TCP pose."""
    import mujoco

    bodies: dict[str, Body] = {}
    world_pose = {i: Pose(np.array(data.xpos[i]), np.array(data.xmat[i]).reshape(3, 3))
                  for i in range(model.nbody)}
    for i in range(model.nbody):
        name = model.body(i).name
        if name in BODY_NAMES:
            bodies[BODY_NAMES[name]] = Body(BODY_NAMES[name], world_pose[i])
    for i in range(1, model.nbody):
        name = model.body(i).name
        if name in ("base",):
            continue  # robosuite's massless mount, welded to link0
        owner = bodies[BODY_NAMES[model.body(_owner(model, i)).name]]
        frame = owner.world.inverse() @ world_pose[i]
        mass = float(model.body_mass[i])
        if mass > 0:  # parallel-axis merge in the owner's frame
            com = frame.rot @ model.body_ipos[i] + frame.pos
            irot = frame.rot @ _quat_wxyz_to_matrix(model.body_iquat[i])
            inertia = irot @ np.diag(model.body_inertia[i]) @ irot.T
            total = owner.mass + mass
            new_com = (owner.com * owner.mass + com * mass) / total

            owner.inertia = (_shift(owner.inertia, owner.mass, owner.com - new_com)
                             + _shift(inertia, mass, com - new_com))
            owner.mass, owner.com = total, new_com
    for g in range(model.ngeom):
        if model.geom_group[g] != 0:
            continue  # visual-only meshes: too fine for a CPU ray tracer
        owner = bodies[BODY_NAMES[model.body(_owner(model, model.geom_bodyid[g])).name]]
        geom_world = Pose(np.array(data.geom_xpos[g]), np.array(data.geom_xmat[g]).reshape(3, 3))
        pose = owner.world.inverse() @ geom_world
        if model.geom_type[g] == mujoco.mjtGeom.mjGEOM_MESH:
            points, faces = _mesh(model, model.geom_dataid[g])
            owner.shapes.append(Shape(pose, points=points, faces=faces))
        elif model.geom_type[g] == mujoco.mjtGeom.mjGEOM_BOX:
            owner.shapes.append(Shape(pose, box=np.array(model.geom_size[g])))
    for mj_name, usd_name in BODY_NAMES.items():  # robosuite gives link 7 no collision geom
        mesh_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_MESH, mj_name)
        if not bodies[usd_name].shapes and mesh_id >= 0:
            points, faces = _mesh(model, mesh_id)
            bodies[usd_name].shapes.append(Shape(Pose(np.zeros(3), np.eye(3)), points, faces))
    tcp_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, TCP_BODY)
    tcp = bodies["panda_hand"].world.inverse() @ world_pose[tcp_id]
    return bodies, tcp


def _axis_token(axis: np.ndarray) -> str:
    k = int(np.argmax(np.abs(axis)))
    if abs(abs(axis[k]) - 1.0) > 1e-6:
        raise ValueError(f"joint axis {axis} is not a principal axis of its frame")
    if axis[k] < 0:
        raise ValueError(f"joint axis {axis} points backwards")
    return "XYZ"[k]


def _gf_quat(rot: np.ndarray) -> Any:
    from pxr import Gf

    w, x, y, z = _matrix_to_quat_wxyz(rot)
    return Gf.Quatf(float(w), float(x), float(y), float(z))


def write_usd(model: Any, data: Any, out: Path) -> dict[str, Any]:
    """Write ``out`` (``.usda``); return the metadata ``panda.json`` records."""
    import mujoco
    from pxr import Gf, Sdf, Usd, UsdGeom, UsdPhysics, Vt

    bodies, tcp = collect(model, data)
    out.unlink(missing_ok=True)
    stage = Usd.Stage.CreateNew(str(out))
    UsdGeom.SetStageUpAxis(stage, UsdGeom.Tokens.z)
    UsdGeom.SetStageMetersPerUnit(stage, 1.0)
    UsdPhysics.SetStageKilogramsPerUnit(stage, 1.0)
    root = UsdGeom.Xform.Define(stage, "/panda")
    stage.SetDefaultPrim(root.GetPrim())
    UsdPhysics.ArticulationRootAPI.Apply(root.GetPrim())
    for body in bodies.values():
        xform = UsdGeom.Xform.Define(stage, f"/panda/{body.name}")
        xform.AddTranslateOp().Set(Gf.Vec3d(*body.world.pos.tolist()))
        w, x, y, z = _matrix_to_quat_wxyz(body.world.rot)
        xform.AddOrientOp().Set(Gf.Quatf(float(w), float(x), float(y), float(z)))
        prim = xform.GetPrim()
        UsdPhysics.RigidBodyAPI.Apply(prim)
        mass_api = UsdPhysics.MassAPI.Apply(prim)
        mass_api.CreateMassAttr(float(body.mass))
        mass_api.CreateCenterOfMassAttr(Gf.Vec3f(*body.com.tolist()))
        values, vectors = np.linalg.eigh(body.inertia)
        if np.linalg.det(vectors) < 0:
            vectors[:, 0] = -vectors[:, 0]
        mass_api.CreateDiagonalInertiaAttr(Gf.Vec3f(*np.maximum(values, 1e-6).tolist()))
        mass_api.CreatePrincipalAxesAttr(_gf_quat(vectors))
        colour = Vt.Vec3fArray([Gf.Vec3f(*COLOURS[body.name])])
        for k, shape in enumerate(body.shapes):
            path = f"/panda/{body.name}/shape_{k}"
            if shape.box is not None:
                geom = UsdGeom.Cube.Define(stage, path)
                geom.CreateSizeAttr(2.0)
                geom.AddTranslateOp().Set(Gf.Vec3d(*shape.pose.pos.tolist()))
                geom.AddOrientOp().Set(_gf_quat(shape.pose.rot))
                geom.AddScaleOp().Set(Gf.Vec3f(*shape.box.tolist()))
            else:
                assert shape.points is not None and shape.faces is not None
                geom = UsdGeom.Mesh.Define(stage, path)
                geom.CreatePointsAttr(Vt.Vec3fArray([Gf.Vec3f(*p) for p in shape.points.tolist()]))
                geom.CreateFaceVertexCountsAttr(Vt.IntArray([3] * len(shape.faces)))
                geom.CreateFaceVertexIndicesAttr(Vt.IntArray(shape.faces.reshape(-1).tolist()))
                geom.CreateSubdivisionSchemeAttr(UsdGeom.Tokens.none)
                geom.AddTranslateOp().Set(Gf.Vec3d(*shape.pose.pos.tolist()))
                geom.AddOrientOp().Set(_gf_quat(shape.pose.rot))
                UsdPhysics.MeshCollisionAPI.Apply(geom.GetPrim()).CreateApproximationAttr(
                    UsdPhysics.Tokens.convexHull)
            geom.CreateDisplayColorAttr(colour)
            UsdPhysics.CollisionAPI.Apply(geom.GetPrim())
    fixed = UsdPhysics.FixedJoint.Define(stage, "/panda/root_joint")
    fixed.CreateBody1Rel().SetTargets([Sdf.Path("/panda/panda_link0")])
    fixed.CreateLocalPos0Attr(Gf.Vec3f(*bodies["panda_link0"].world.pos.tolist()))
    fixed.CreateLocalRot0Attr(_gf_quat(bodies["panda_link0"].world.rot))
    fixed.CreateLocalPos1Attr(Gf.Vec3f(0, 0, 0))
    fixed.CreateLocalRot1Attr(Gf.Quatf(1, 0, 0, 0))
    joints: list[dict[str, Any]] = []
    for j in range(model.njnt):
        name = JOINT_NAMES[model.joint(j).name]
        child_mj = model.jnt_bodyid[j]
        child = bodies[BODY_NAMES[model.body(child_mj).name]]
        parent = bodies[BODY_NAMES[model.body(_owner(model, model.body_parentid[child_mj])).name]]
        # the joint frame: at the joint's anchor, oriented like the child body's own frame
        mj_child = Pose(np.array(data.xpos[child_mj]), np.array(data.xmat[child_mj]).reshape(3, 3))
        anchor = mj_child @ Pose(np.array(model.jnt_pos[j]), np.eye(3))
        local1 = child.world.inverse() @ anchor
        local0 = parent.world.inverse() @ anchor
        axis = _axis_token(np.array(model.jnt_axis[j]))
        revolute = model.jnt_type[j] == mujoco.mjtJoint.mjJNT_HINGE
        kind = UsdPhysics.RevoluteJoint if revolute else UsdPhysics.PrismaticJoint
        joint = kind.Define(stage, f"/panda/{child.name}/{name}")
        joint.CreateBody0Rel().SetTargets([Sdf.Path(f"/panda/{parent.name}")])
        joint.CreateBody1Rel().SetTargets([Sdf.Path(f"/panda/{child.name}")])
        joint.CreateLocalPos0Attr(Gf.Vec3f(*local0.pos.tolist()))
        joint.CreateLocalRot0Attr(_gf_quat(local0.rot))
        joint.CreateLocalPos1Attr(Gf.Vec3f(*local1.pos.tolist()))
        joint.CreateLocalRot1Attr(_gf_quat(local1.rot))
        joint.CreateAxisAttr(axis)
        low, high = (float(v) for v in model.jnt_range[j])
        scale = 180.0 / np.pi if revolute else 1.0
        joint.CreateLowerLimitAttr(low * scale)
        joint.CreateUpperLimitAttr(high * scale)
        drive = UsdPhysics.DriveAPI.Apply(joint.GetPrim(), "angular" if revolute else "linear")
        drive.CreateTypeAttr("force")
        drive.CreateStiffnessAttr(400.0 if revolute else 2000.0)
        drive.CreateDampingAttr(40.0 if revolute else 100.0)
        joints.append({"name": name, "type": "revolute" if revolute else "prismatic",
                       "lower": low, "upper": high, "axis": axis, "parent": parent.name,
                       "child": child.name})
    jointed = {BODY_NAMES[model.body(model.jnt_bodyid[j]).name] for j in range(model.njnt)}
    for mj_name, name in BODY_NAMES.items():  # bodies MuJoCo welds to their parent (the hand)
        if name in jointed or name == "panda_link0":
            continue
        mj_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, mj_name)
        parent = bodies[BODY_NAMES[model.body(_owner(model, model.body_parentid[mj_id])).name]]
        child = bodies[name]
        weld = UsdPhysics.FixedJoint.Define(stage, f"/panda/{name}/{parent.name}_to_{name}")
        local0 = parent.world.inverse() @ child.world
        weld.CreateBody0Rel().SetTargets([Sdf.Path(f"/panda/{parent.name}")])
        weld.CreateBody1Rel().SetTargets([Sdf.Path(f"/panda/{name}")])
        weld.CreateLocalPos0Attr(Gf.Vec3f(*local0.pos.tolist()))
        weld.CreateLocalRot0Attr(_gf_quat(local0.rot))
        weld.CreateLocalPos1Attr(Gf.Vec3f(0, 0, 0))
        weld.CreateLocalRot1Attr(Gf.Quatf(1, 0, 0, 0))
    stage.GetRootLayer().Save()
    return {
        "source": "robosuite models/assets/robots/panda/robot.xml + grippers/panda_gripper.xml",
        "joints": joints,
        "bodies": list(bodies),
        "home": HOME,
        "tcp_body": "panda_hand",
        "tcp_offset": [round(float(v), 6) for v in tcp.pos],
        "faces": {b.name: int(sum(len(s.faces) if s.faces is not None else 12
                                  for s in b.shapes)) for b in bodies.values()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.isaaclab.build_assets",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--robosuite", type=Path, required=True,
                        help="the robosuite package directory (holds models/assets)")
    parser.add_argument("--out", type=Path, default=ASSETS, help="output directory")
    args = parser.parse_args(argv)
    model, data = _load(args.robosuite)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = write_usd(model, data, args.out / "panda.usda")
    version = re.search(r'__version__ = "([^"]+)"', (args.robosuite / "__init__.py").read_text())
    meta["robosuite"] = version.group(1) if version else "unknown"
    (args.out / "panda.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps({"usd": str(args.out / "panda.usda"), "faces": meta["faces"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
