"""Calibration of TOPLOC verification bounds for one model (`sglang-rl calibrate`).

* measure.py: honest recomputation noise and cheaper models, measured with plain transformers,
  as JSON-lines records (`sglang-rl calibrate` measures them itself);
* servers.py: the same records from real servers, a generator checked by a verifier
  (`sglang-rl calibrate-server`);
* rollouts.py: a generator's responses saved on one host and verified on another (another GPU
  type), into the same records;
* fit.py: bounds and score histograms fitted to the records, written as a calibration file that
  `--toploc-verification-calibration` reads (`sglang_rl.fingerprint.calibration`).
"""
