# rq-dashboard for the mesh. 0.9.0 imports `six` without declaring it; the Redis URL comes from
# RQ_DASHBOARD_REDIS_URL. It runs through gpumesh/server/rq_dashboard.py (standard library, RQ and rq-dashboard
# only): rq-dashboard reads a busy worker's current job with pickle whatever -j says, and any credential that
# may write RQ's keys could plant one; there RQ's default serializer is JSON, so nothing it reads is run.
FROM python:3.12-slim
RUN pip install --no-cache-dir rq-dashboard==0.9.0 rq==3.0.0 six==1.17.0 \
 && useradd --create-home --uid 10001 dashboard
COPY gpumesh/server/rq_dashboard.py /opt/gpumesh/rq_dashboard_json.py
USER dashboard
EXPOSE 9181
# --disable-delete: watching the mesh must not delete its deliveries or empty its registries on a click
CMD ["python", "/opt/gpumesh/rq_dashboard_json.py", "-j", "--disable-delete", "--bind", "0.0.0.0", "--port", "9181"]
