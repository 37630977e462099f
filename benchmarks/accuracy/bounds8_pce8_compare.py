"""Compare the pce8 passkey rows of the JSON files given, case by case (length, depth, budget), with the fp16 and pc8
rows of bounds8_encodings2_passkey.json:

    python benchmarks/accuracy/bounds8_pce8_compare.py benchmarks/accuracy/bounds8_pce8_passkey_{4k,8k}.json
"""
import json
import sys
from pathlib import Path

REF = Path(__file__).with_name("bounds8_encodings2_passkey.json")


def rows_of(policy, rows):
    return {(r["length"], r["depth"], r["budget"]): r for r in rows if r["policy"] == policy}


def main(paths):
    ref = json.loads(REF.read_text())["rows"]
    fp16, pc8 = rows_of("quest_fp16", ref), rows_of("quest_pc8", ref)
    same = differ = text = 0
    for path in paths:
        for key, row in rows_of("quest_pce8", json.loads(Path(path).read_text())["rows"]).items():
            want = fp16[key]
            if want["correct"] == row["correct"]:
                same += 1
            else:
                differ += 1
                print("differs from fp16:", key, "fp16", want["correct"], "pce8", row["correct"])
            if want["answer"] != row["answer"]:
                text += 1
                print("answer text differs from fp16:", key, "both correct:", want["correct"], row["correct"],
                      "| pc8's answer equal to pce8's:", key in pc8 and pc8[key]["answer"] == row["answer"])
    print(f"cases as fp16: {same}, differing: {differ}, answer text differing from fp16: {text}")


if __name__ == "__main__":
    main(sys.argv[1:])
