"""Worlds: procedural data with their own rewards, used by the trainer the way a user's task would be.

Each world registers its rewards through the setup.py entry-point group ``ddpo_grpo.rewards``, like any
reward plugin; `ddpo_grpo.rewards` itself imports no world.

  - `toyworld`: coloured shapes at places, prompts, and the pixel verifier reward `toyworld`.
  - `recam`: camera re-rendering of a small scene, its conditions, and the rewards `cam_score`, `unifiedscore`
    (`cam_score` also reads any clip's camera in 3-D: `recam.pose_reward`, `recam.pose_estimators`).
  - `room3d`: the 3-D camera world: textured rooms ray-cast along ReCamMaster's trajectories (`data.name="room3d"`),
    scored by `cam_score` with its own exact camera estimator or the default one.
"""
