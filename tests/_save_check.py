"""Load what tests/_save_train.py saved and predict the same probe, in a fresh process.

Usage: python _save_check.py SAVE_DIR...   -> one JSON line per SAVE_DIR {name: predictions or an error}
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    probe = rng.normal(size=(256, 8)).astype("float32")[:16]
    for save_dir in sys.argv[1:]:
        out: dict = {}
        for name in ("best.keras", "final.keras", "explicit.keras", "final.weights.h5"):
            path = os.path.join(save_dir, name)
            try:
                if name.endswith(".weights.h5"):
                    model = keras.Sequential(
                        [
                            keras.Input((8,)),
                            keras.layers.Dense(16, activation="relu"),
                            keras.layers.Dense(1),
                        ]
                    )
                    model.load_weights(path)
                else:
                    model = keras.saving.load_model(path)
                out[name] = model(probe).numpy().tolist()
            except Exception as e:  # the test reports which file did not load, and why
                out[name] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
