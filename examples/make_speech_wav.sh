#!/usr/bin/env bash
# How examples/speech.wav was made (espeak-ng 1.51, Debian): a 3.4 s English sentence, 22.05 kHz 16-bit mono.
# Kept at espeak's own rate so the demo also exercises the resampling to 24 kHz.
set -euo pipefail
espeak-ng -v en-us -s 150 -w "$(dirname "$0")/speech.wav" "The quick brown fox jumps over the lazy dog."
