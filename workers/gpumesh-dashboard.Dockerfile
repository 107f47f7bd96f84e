# gpumesh's own dashboard (`gpumesh dashboard`, the [dashboard] extra), built from this checkout. The broker
# URL comes from GPUMESH_URL; docker-compose.yml runs it --read-only, and only on 127.0.0.1 of the host.
FROM python:3.12-slim
COPY pyproject.toml README.md /src/
COPY gpumesh /src/gpumesh
RUN pip install --no-cache-dir '/src[dashboard]' && useradd --create-home --uid 10001 gpumesh
USER gpumesh
ENV PYTHONUNBUFFERED=1
EXPOSE 9181
CMD ["gpumesh", "dashboard", "--host", "0.0.0.0", "--port", "9181", "--read-only"]
