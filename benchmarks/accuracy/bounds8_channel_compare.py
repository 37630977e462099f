"""Compare the `bounds int8_channel` passkey rows of a scripts/passkey.py JSON, case by case (length, depth, budget),
with the key-dtype and int8 rows of passkey_bounds8_smollm2.json (same protocol: --lengths 4096 8192 --depths 5):

    python benchmarks/accuracy/bounds8_channel_compare.py benchmarks/accuracy/bounds8_channel_passkey.json
"""
import json
import sys
from pathlib import Path

REF = Path(__file__).with_name("passkey_bounds8_smollm2.json")


def rows_of(rows, variant):
    return {(r["length"], r["depth"], r["budget"]): r for r in rows
            if r["policy"] == "quest" and r["variant"] == variant}


def main(path):
    ref = json.loads(REF.read_text())["rows"]
    key, int8 = rows_of(ref, ""), rows_of(ref, "bounds int8")
    chan = rows_of(json.loads(Path(path).read_text())["rows"], "bounds int8_channel")
    same = differ = text = int8_differ = 0
    for k, row in sorted(chan.items()):
        if key[k]["correct"] == row["correct"]:
            same += 1
        else:
            differ += 1
            print("differs from key dtype:", k, "key dtype", key[k]["correct"], "int8_channel", row["correct"])
        if key[k]["answer"] != row["answer"]:
            text += 1
            print("answer text differs from key dtype:", k, "correct (key dtype, int8_channel):", key[k]["correct"],
                  row["correct"])
        int8_differ += key[k]["correct"] != int8[k]["correct"]
    print(f"int8_channel cases as key dtype: {same} of {len(chan)}, differing: {differ}, "
          f"answer text differing: {text}; "
          f"int8 (per-page scale) cases differing from key dtype: {int8_differ}")


if __name__ == "__main__":
    main(sys.argv[1])
