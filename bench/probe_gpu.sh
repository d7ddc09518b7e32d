python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
nproc; python3 -c "import modelopt.torch.quantization, onnx_graphsurgeon, faster_coco_eval; print('imports ok')"
python3 bench/probe_train_gpu.py
python3 - <<'PY'
import time
from prep.data.synth import generate_dataset
t=time.time(); generate_dataset('/tmp/g', 400, 0, workers=14); print('gen 400 imgs', time.time()-t, 's')
PY
