from rest_framework.pagination import PageNumberPagination


class MeridianPagination(PageNumberPagination):
    """?page=N&page_size=M (at most 500), so a 100k-row list is never one response."""

    page_size_query_param = "page_size"
    max_page_size = 500
