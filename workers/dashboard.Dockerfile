# rq-dashboard for the mesh. 0.9.0 imports `six` without declaring it; the JSON serializer is set by
# -j (gpumesh never uses pickle); the Redis URL comes from RQ_DASHBOARD_REDIS_URL.
FROM python:3.12-slim
RUN pip install --no-cache-dir rq-dashboard==0.9.0 six==1.17.0 \
 && useradd --create-home --uid 10001 dashboard
USER dashboard
EXPOSE 9181
# --disable-delete: watching the mesh must not delete its deliveries or empty its registries on a click
CMD ["rq-dashboard", "-j", "--disable-delete", "--bind", "0.0.0.0", "--port", "9181"]
