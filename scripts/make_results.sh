#!/usr/bin/env bash
# Re-runs the study of docs/results.md: LR sweep (item 1), ablations (2), PiSSA/MiLoRA (3), rank-one
# analysis (4), and copies the tables and figures into docs/results/. Resumable: `anlr sweep` skips
# cells that already have a results.json. ~35 min on 2 idle CPU cores.
#   bash scripts/make_results.sh [RUNS_DIR]      (default runs/results; run from the repo root)
set -euo pipefail
RUNS=${1:-runs/results}
CONFIG=configs/results_quickstart.yaml
DOCS=docs/results
mkdir -p "$RUNS" "$DOCS"

# 1. LR robustness (paper Tab. 7 / Fig. 5): 4 methods x 6 LRs (20x range) x 2 seeds.
anlr sweep --config "$CONFIG" --methods lora,rslora,loraplus,anlr \
  --lrs 1e-3,2e-3,3e-3,5e-3,1e-2,2e-2 --seeds 0,1 --out "$RUNS/lr_sweep"

# The best LoRA LR (highest mean over seeds) is the LR of items 2-4.
BEST_LR=$(python - "$RUNS/lr_sweep/summary.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r['method'] == 'lora']
print(max(rows, key=lambda r: float(r['mean']))['learning_rate'])
PY
)
echo "best LoRA learning rate: $BEST_LR"

# lora and anlr cells at BEST_LR are the same runs as in the LR sweep: reuse them, don't retrain.
reuse() {  # reuse METHOD OUT
  local src="$RUNS/lr_sweep/$1/lr$(python -c "print(f'{float(\"$BEST_LR\"):g}')")"
  local dst="$2/$1/lr$(python -c "print(f'{float(\"$BEST_LR\"):g}')")"
  mkdir -p "$dst"
  for s in "$src"/seed*; do [ -e "$dst/$(basename "$s")" ] || cp -r "$s" "$dst/"; done
}

# 2. Signal ablation (Tab. 6 + Tab. 9) at BEST_LR, 3 seeds (seed 2 of lora and anlr runs here).
reuse lora "$RUNS/ablation"; reuse anlr "$RUNS/ablation"
anlr sweep --config "$CONFIG" --methods lora,anlr-velocity,anlr-snr,anlr,random,sensitivity \
  --lrs "$BEST_LR" --seeds 0,1,2 --out "$RUNS/ablation"

# 3. AnLR on LoRA variants (Tab. 5) at BEST_LR.
anlr sweep --config "$CONFIG" --methods pissa,anlr+pissa,milora,anlr+milora \
  --lrs "$BEST_LR" --seeds 0,1,2 --out "$RUNS/variants"

# 4. Rank-one analysis (Fig. 1-3): LoRA (tracked with signal="uniform") and AnLR, diagnostics every 5 steps.
for m in lora anlr; do
  [ -e "$RUNS/analysis/$m/results.json" ] || anlr train --config "$CONFIG" method=$m seed=0 \
    trainer.learning_rate="$BEST_LR" trainer.diag_every=5 run_dir="$RUNS/analysis/$m"
done
anlr analyze "$RUNS/analysis/lora" "$RUNS/analysis/anlr" --out "$RUNS/analysis/figures"

# 5. The other baselines (AdaLoRA, LoRA-Pro, LoRA-Dash, AnLR on LoRA-Dash) next to LoRA and AnLR;
#    LoRA-Dash launches after 10 % of the updates (the paper's t = 100 is longer than these runs).
BASE=(loradash.launch_step=10 trainer.diag_every=0)
anlr sweep --config "$CONFIG" --methods lora,anlr,adalora,lorapro,loradash,anlr+loradash \
  --lrs 0.005 --seeds 0,1 --out "$RUNS/baselines" "${BASE[@]}"
anlr sweep --config "$CONFIG" --methods lorapro,loradash,anlr+loradash \
  --lrs 0.002,0.01 --seeds 0,1 --out "$RUNS/baselines_lr" "${BASE[@]}"
anlr sweep --config "$CONFIG" --methods adalora --lrs 0.01,0.02,0.05 --seeds 0,1 \
  --out "$RUNS/adalora_lr" "${BASE[@]}"
mkdir -p "$DOCS/baselines"
cp "$RUNS/baselines/results.csv" "$DOCS/baselines/results_5e-3.csv"
cp "$RUNS/baselines_lr/results.csv" "$DOCS/baselines/results_2e-3_1e-2.csv"
cp "$RUNS/adalora_lr/results.csv" "$DOCS/baselines/results_adalora_lr.csv"

# Copy tables and figures into the repo.
for d in lr_sweep ablation variants; do
  mkdir -p "$DOCS/$d"
  cp "$RUNS/$d"/{results.csv,summary.csv,summary.md} "$DOCS/$d/"
done
cp "$RUNS/lr_sweep/accuracy_vs_lr.png" "$DOCS/lr_sweep/"
mkdir -p "$DOCS/analysis"
cp "$RUNS/analysis/figures"/*.{png,csv,md} "$DOCS/analysis/"
